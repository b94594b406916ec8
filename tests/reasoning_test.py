"""Tests for the reasoning task family: generator, chains checked by brute force, reward, tokenizer."""

import jax
import numpy as np
import pytest
from scipy import stats

from ebpo_jax import tasks
from ebpo_jax.spec import resolve
from ebpo_jax.tasks import BOS_ID, EOS_ID, PAD_ID
from ebpo_jax.tasks import protocol as task
from ebpo_jax.tasks import reasoning as R
from ebpo_jax.tasks.families import reasoning as task_reasoning


def load_problems(config):
    return task_reasoning.load_problems(resolve(config).task)


TOK = R.make_tokenizer()


@pytest.fixture(scope="module")
def splits():
    return R.make_splits(0, train_per_cell=100, test_per_cell=20)


def test_generator_deterministic_and_seed_dependent(splits):
    assert R.make_splits(0, train_per_cell=100, test_per_cell=20) == splits
    other = R.make_splits(1, train_per_cell=100, test_per_cell=20)
    assert [p.prompt for p in other[0]] != [p.prompt for p in splits[0]]


def test_splits_disjoint_unique_and_test_independent_of_train_size(splits):
    train, test = splits
    prompts = {p.prompt for p in train}
    assert len(prompts) == len(train) == 100 * 9 and len(test) == 20 * 9
    assert len({p.prompt for p in test}) == len(test) and not prompts & {p.prompt for p in test}
    assert len({p.id for p in train + test}) == len(train + test)
    assert R.make_splits(0, train_per_cell=300, test_per_cell=20)[1] == test


def _check_chain(p) -> None:
    """Every step is a true equation, the chain is complete, and it ends in the answer."""
    body, marker, answer = p.completion.rpartition(R.MARKER)
    assert marker and answer == p.answer and body.endswith(R.STEP_SEP)
    steps = body[:-1].split(R.STEP_SEP)
    for s in steps:
        lhs, rhs = s.split("=")
        assert eval(lhs) == int(rhs), (p, s)  # Python's own arithmetic is the reference
    expr = p.prompt[:-1]
    assert int(p.answer) == eval(expr), p
    sums = [int(s.split("=")[1]) for s in steps]
    if p.topic == "carry_add":
        a, b = expr.split("+")
        assert len(steps) == max(len(a), len(b))
        carries = [int(s.split("=")[0].split("+")[2]) for s in steps]
        assert carries == [0] + [x // 10 for x in sums[:-1]]  # the carry written is the real one
        digits = "".join(str(x % 10) for x in reversed(sums))
        assert str(int(str(sums[-1] // 10) + digits)) == p.answer
    elif p.topic == "carry_mul":
        a, _ = expr.split("*")
        assert len(steps) == len(a)
        carries = [int(s.split("+")[1].split("=")[0]) for s in steps]
        assert carries == [0] + [x // 10 for x in sums[:-1]]
    else:
        assert len(steps) == expr.count("+") + expr.count("-")
        assert all(x >= 0 for x in sums)  # intermediates stay non-negative


def test_every_chain_and_answer_verified(splits):
    train, test = splits
    cells = set()
    for p in train + test:
        _check_chain(p)
        assert R.solve(p.topic, p.prompt) == (p.completion, p.answer)
        assert R.TOPICS[p.topic_id] == p.topic and p.difficulty in R.DIFFICULTIES
        assert R.MIN_RESPONSE_TOKENS <= len(p.completion) + 1 <= R.MAX_RESPONSE_TOKENS
        cells.add((p.topic, p.difficulty))
    assert len(cells) == len(R.TOPICS) * len(R.DIFFICULTIES)


def test_lengths_grow_with_difficulty_and_are_right_skewed(splits):
    train, _ = splits
    for topic in R.TOPICS:
        means = [
            R.response_lengths([p for p in train if (p.topic, p.difficulty) == (topic, d)]).mean()
            for d in R.DIFFICULTIES
        ]
        assert means == sorted(means), (topic, means)
    lengths = R.response_lengths(train)
    assert lengths.min() >= 16 and lengths.max() <= 64
    assert stats.skew(lengths) > 0.2 and np.percentile(lengths, 99) > 55


def test_bad_generator_arguments_raise():
    with pytest.raises(ValueError, match="division"):
        R.make_splits(0, topics=("division",))
    with pytest.raises(ValueError, match="difficulty"):
        R.make_splits(0, difficulties=(4,))
    with pytest.raises(ValueError, match=">= 0"):
        R.make_splits(0, train_per_cell=-1)


def test_tokenizer_round_trip_and_shared_ids(splits):
    train, _ = splits
    arith = tasks.CharTokenizer()
    assert TOK.vocab_size == arith.vocab_size + 2
    assert all(TOK.encode(c) == arith.encode(c) for c in arith.alphabet)
    assert TOK.encode(R.MARKER) == [R.MARKER_ID]
    for p in train[::37]:
        text = p.prompt + p.completion
        ids = TOK.encode(text, add_bos=True, add_eos=True)
        assert ids[0] == BOS_ID and ids[-1] == EOS_ID and TOK.decode(ids) == text


def _reference_reward(ids, length, answer) -> float:
    """Brute force on Python lists: content to the first EOS; ids after its last MARKER."""
    ids = [int(i) for i in ids[:length]]
    if EOS_ID not in ids:
        return 0.0
    content = ids[: ids.index(EOS_ID)]
    if R.MARKER_ID not in content:
        return 0.0
    last = len(content) - 1 - content[::-1].index(R.MARKER_ID)
    return float(content[last + 1 :] == TOK.encode(answer))


def _rows(texts_eos, width):
    rows = [TOK.encode(t, add_eos=eos) for t, eos in texts_eos]
    out = np.zeros((len(rows), width), np.int32)
    for b, r in enumerate(rows):
        out[b, : len(r)] = r
    return out, np.array([len(r) for r in rows], np.int32)


def _check(comp, lens, answers):
    ans_tok, ans_len = TOK.encode_batch(answers)
    got = np.asarray(jax.jit(R.reward_fn)(comp, lens, ans_tok, ans_len))
    want = [_reference_reward(c, n, a) for c, n, a in zip(comp, lens, answers)]
    np.testing.assert_array_equal(got, want)
    return got


def test_reward_hand_written_responses():
    cases = [
        (("7+5+0=12;4+8+1=13;#132", True), 1.0),
        (("#132", True), 1.0),  # only the final answer is scored
        (("7+5+0=12;#999;#132", True), 1.0),  # the last marker counts
        (("7+5+0=12;4+8+1=13;#132", False), 0.0),  # truncated: no EOS
        (("7+5+0=12;4+8+1=13;132", True), 0.0),  # no marker
        (("7+5+0=12;#13", True), 0.0),  # prefix of the answer
        (("#1320", True), 0.0),  # junk after the answer
        (("#132;", True), 0.0),
        (("#0132", True), 0.0),
        (("#", True), 0.0),
        (("", True), 0.0),
        (("", False), 0.0),
    ]
    comp, lens = _rows([c for c, _ in cases], width=26)
    got = _check(comp, lens, ["132"] * len(cases))
    np.testing.assert_array_equal(got, [w for _, w in cases])
    for (text, eos), want in cases:
        assert R.string_reward(text, "132", has_eos=eos) == want
    # After EOS, and beyond the length, nothing counts; a pad inside the answer does.
    m, one, three, two = R.MARKER_ID, *TOK.encode("132")
    rows = np.array(
        [
            [m, one, three, two, EOS_ID, m, 5, 5],
            [m, one, three, two, EOS_ID, 9, 9, 9],
            [m, one, PAD_ID, three, two, EOS_ID, 0, 0],
        ],
        np.int32,
    )
    got = _check(rows, np.array([8, 4, 8], np.int32), ["132"] * 3)
    np.testing.assert_array_equal(got, [1.0, 0.0, 0.0])


def test_reward_random_cases_match_reference(splits):
    train, _ = splits
    rng = np.random.default_rng(0)
    problems = [train[i] for i in rng.integers(0, len(train), 256)]
    texts = []
    for p in problems:  # gold, cut gold, gold + junk, and random noise with markers
        kind, c = rng.integers(4), p.completion
        if kind == 0:
            texts.append((c, True))
        elif kind == 1:
            texts.append((c[: rng.integers(len(c) + 1)], bool(rng.integers(2))))
        elif kind == 2:
            texts.append((c + "".join(rng.choice(list("0#;1")) for _ in range(2)), True))
        else:
            texts.append(("".join(rng.choice(list("0123456789#;+=")) for _ in range(9)), True))
    width = R.MAX_RESPONSE_TOKENS + 3
    comp, lens = _rows(texts, width)
    junk = rng.integers(0, TOK.vocab_size, comp.shape).astype(np.int32)
    comp = np.where(np.arange(width)[None] < lens[:, None], comp, junk)
    got = _check(comp, lens, [p.answer for p in problems])
    assert 0.2 < got.mean() < 0.8
    noise = rng.choice([R.MARKER_ID, EOS_ID, PAD_ID, BOS_ID, 3, 4, 5], (256, 6)).astype(np.int32)
    _check(noise, rng.integers(0, 7, 256).astype(np.int32), ["1", "12"] * 128)


def test_sft_examples_train_on_the_whole_chain(splits):
    train, _ = splits
    sft = tasks.sft_examples(train[:16], TOK)
    for p, row, mask, n in zip(train[:16], sft.tokens, sft.loss_mask, sft.lengths):
        assert TOK.decode(row[:n]) == p.prompt + p.completion
        assert TOK.decode(row[mask], stop_at_eos=False) == p.completion
        assert row[mask][-1] == EOS_ID


def test_prompt_batches_hold_the_final_answer(splits):
    _, test = splits
    batch = tasks.encode_problems(test, TOK)
    gold = [(p.completion, True) for p in test]
    comp, lens = _rows(gold, R.MAX_RESPONSE_TOKENS)
    r = R.reward_fn(comp, lens, batch.answer_tokens, batch.answer_lengths)
    assert np.asarray(r).tolist() == [1.0] * len(test)
    for p, row, n in zip(test, batch.answer_tokens, batch.answer_lengths):
        assert TOK.decode(row[:n]) == p.answer


def test_reasoning_config_is_valid_and_family_is_checked():
    from ebpo_jax.ablation.grid import load_config_file
    from ebpo_jax.config import ConfigError, validate

    config = load_config_file("configs/reasoning.py")
    validate(config)
    assert config.task.family == "reasoning"
    _, train, test = load_problems(config)
    prompt_len = max(len(p.prompt) for p in train + test) + 1  # BOS
    assert prompt_len + config.sampler.max_new_tokens <= (
        config.model.overrides.max_position_embeddings
    )
    assert config.sampler.max_new_tokens == R.MAX_RESPONSE_TOKENS
    with pytest.raises(ConfigError, match="task.family='geometry'"):
        task.get("geometry")  # the family registry: before anything is built or compiled
