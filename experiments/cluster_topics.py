"""Label each problem with a topic cluster: all-MiniLM-L6-v2 embeddings + k-means (EBPO-topic).

python experiments/cluster_topics.py --data=/data/dapo.parquet --schema=dapo \
  --k=10 --out=/data/dapo_topics.jsonl
The output holds the records with `topic` set to the cluster id; train on it with schema
"record", data.topics="field" and data.order="topic". Computing the labels once (rather than
data.topics="kmeans" at start-up) keeps them identical on every host and across resumes.
Needs the [cluster] extra.
"""

import dataclasses
from collections import Counter

from absl import flags

from ebpo_jax import cli

_DATA = flags.DEFINE_string("data", None, "Dataset file or folder.")
_SCHEMA = flags.DEFINE_string("schema", "record", "Schema name (ebpo_jax.data.SCHEMAS).")
_OUT = flags.DEFINE_string("out", None, "Output .jsonl path.")
_K = flags.DEFINE_integer("k", 10, "Number of clusters (the authors used 10).")
_SEED = flags.DEFINE_integer("seed", 0, "k-means seed.")


def main(argv):
    del argv
    from ebpo_jax.data import cluster_texts, load_records, save_records

    records = load_records(_DATA.value, _SCHEMA.value)
    labels = cluster_texts([r.prompt for r in records], _K.value, seed=_SEED.value)
    out = [dataclasses.replace(r, topic=str(int(t))) for r, t in zip(records, labels)]
    save_records(out, _OUT.value)
    sizes = sorted(Counter(labels.tolist()).items())
    print(f"{len(records)} problems in {_K.value} clusters {sizes}; wrote {_OUT.value}")


if __name__ == "__main__":
    from ebpo_jax.runtime.cpu_flags import add_cpu_flags

    add_cpu_flags()  # XLA:CPU flags, before jax starts a backend
    flags.mark_flags_as_required(["data", "out"])
    cli.run(main)
