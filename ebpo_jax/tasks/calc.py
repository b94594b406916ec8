"""The reasoning problems with a calculator tool (ebpo_jax.tasks.envs.calculator).

Same problems, topics and final-answer reward as ebpo_jax.tasks.reasoning; a completion may
call the tool, `<calc>47+85</calc>`, read its value (an observation the environment
writes) and answer after "#": "<calc>47+85</calc>132#132". The SFT warm start sees the
tool on a seeded TOOL_SFT_FRAC of the training problems and the written chain of steps on
the rest, so the warm-started policy calls the tool on some problems; the observation is
off the SFT loss (sft_examples), so the policy learns to copy the value it reads rather
than to guess it. A tool episode then succeeds far more often than a written chain: RL
can raise both the tool-call rate and the pass rate.
"""

import dataclasses
import zlib

from ebpo_jax.tasks import reasoning
from ebpo_jax.tasks import synthetic as data
from ebpo_jax.tasks.envs.calculator import CLOSE, OPEN
from ebpo_jax.tasks.tokenizer import CharTokenizer

TOPICS, DIFFICULTIES = reasoning.TOPICS, reasoning.DIFFICULTIES
# A superset of the reasoning alphabet (shared characters keep their ids, MARKER included).
ALPHABET = reasoning.ALPHABET + "cal/"
MARKER_ID = reasoning.MARKER_ID
TOOL_SFT_FRAC = 0.5
# Names these SFT targets in the warm start's cache key (trainer/sft.py): change it with them.
SFT_DATA_KEY = f"calc: tool_frac={TOOL_SFT_FRAC}, observation off the loss"
reward_fn = reasoning.reward_fn


def make_tokenizer() -> CharTokenizer:
    return CharTokenizer(ALPHABET)


def tool_completion(prompt: str, answer: str) -> str:
    """The tool-using completion, observation included: "<calc>EXPR</calc>VALUE#VALUE"."""
    return f"{OPEN}{prompt.removesuffix('=')}{CLOSE}{answer}{reasoning.MARKER}{answer}"


def uses_tool(problem_id: str, frac: float | None = None) -> bool:
    """Whether the SFT target of this problem calls the tool (a seeded hash of its id)."""
    frac = TOOL_SFT_FRAC if frac is None else frac
    return zlib.crc32(problem_id.encode()) % 1000 < frac * 1000


def sft_examples(problems, tokenizer: CharTokenizer, *, seq_len: int | None = None):
    """data.sft_examples with the observation (the value after CLOSE) off the loss: the
    environment writes it, so the policy learns to read it, never to predict it."""
    ex = data.sft_examples(problems, tokenizer, seq_len=seq_len)
    mask = ex.loss_mask.copy()
    for i, p in enumerate(problems):
        close = p.completion.find(CLOSE)
        if close >= 0:  # char tokens: completion offset k is position 1 + len(prompt) + k
            lo = 1 + len(p.prompt) + close + len(CLOSE)
            mask[i, lo : 1 + len(p.prompt) + p.completion.index(reasoning.MARKER, close)] = False
    return ex._replace(loss_mask=mask)


def make_splits(seed: int, **kw):
    """reasoning.make_splits, with a tool-using SFT completion on TOOL_SFT_FRAC of train."""
    train, test = reasoning.make_splits(seed, **kw)
    with_tool = lambda p: dataclasses.replace(p, completion=tool_completion(p.prompt, p.answer))
    return [with_tool(p) if uses_tool(p.id) else p for p in train], test
