"""What a run trains on: the task protocol and registry (`protocol.py`), the families
(`families/`), environments (`envs/`), the math records' prompt source (`math_source.py`), and
the synthetic tasks re-exported here: problems, a char tokenizer, exact-answer rewards, batching."""

from ebpo_jax.tasks.arithmetic import (
    DIFFICULTIES,
    TOPICS,
    Problem,
    make_splits,
    max_lengths,
    solve,
)
from ebpo_jax.tasks.reward import group_reward_fn, host_reward, reward_fn, string_reward
from ebpo_jax.tasks.synthetic import (
    ORDERS,
    PromptBatch,
    PromptSource,
    SFTBatch,
    encode_problems,
    sft_examples,
)
from ebpo_jax.tasks.tokenizer import BOS_ID, EOS_ID, PAD_ID, CharTokenizer

__all__ = [
    "BOS_ID",
    "DIFFICULTIES",
    "EOS_ID",
    "ORDERS",
    "PAD_ID",
    "TOPICS",
    "CharTokenizer",
    "Problem",
    "PromptBatch",
    "PromptSource",
    "SFTBatch",
    "encode_problems",
    "group_reward_fn",
    "host_reward",
    "make_splits",
    "max_lengths",
    "reward_fn",
    "sft_examples",
    "solve",
    "string_reward",
]
