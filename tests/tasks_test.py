"""Tests for the synthetic arithmetic tasks: generator, tokenizer, rewards, batching."""

import re

import jax
import numpy as np
import pytest

from ebpo_jax import tasks
from ebpo_jax.tasks import BOS_ID, EOS_ID, PAD_ID

TOK = tasks.CharTokenizer()


@pytest.fixture(scope="module")
def splits():
    return tasks.make_splits(0, train_per_cell=100, test_per_cell=20)


def _brute_force(prompt: str) -> str:
    m = re.fullmatch(r"(\d+)([-+*%?])(\d+)=", prompt)
    assert m, prompt
    a, op, b = int(m[1]), m[2], int(m[3])
    if op == "?":
        return "<" if a < b else ">" if a > b else "="
    return str(eval(f"{a}{op}{b}"))  # the independent reference: Python's own arithmetic


def test_generator_deterministic_and_seed_dependent(splits):
    again = tasks.make_splits(0, train_per_cell=100, test_per_cell=20)
    assert again == splits
    other = tasks.make_splits(1, train_per_cell=100, test_per_cell=20)
    assert [p.prompt for p in other[0]] != [p.prompt for p in splits[0]]


def test_splits_disjoint_unique_and_test_independent_of_train_size(splits):
    train, test = splits
    train_prompts = {p.prompt for p in train}
    assert len(train_prompts) == len(train)
    assert len({p.prompt for p in test}) == len(test)
    assert not train_prompts & {p.prompt for p in test}
    assert len({p.id for p in train + test}) == len(train + test)
    _, test_big = tasks.make_splits(0, train_per_cell=300, test_per_cell=20)
    assert test_big == test


def test_every_answer_correct_and_fields_consistent(splits):
    train, test = splits
    cells = set()
    for p in train + test:
        assert p.answer == _brute_force(p.prompt), p
        assert tasks.TOPICS[p.topic_id] == p.topic
        assert p.difficulty in tasks.DIFFICULTIES
        cells.add((p.topic, p.difficulty))
        # BOS + prompt + answer + EOS must stay short for the tiny CPU policy.
        assert len(p.prompt) + len(p.answer) + 2 <= 16
    assert len(cells) == len(tasks.TOPICS) * len(tasks.DIFFICULTIES)


def test_difficulty_grows_with_operand_size(splits):
    train, _ = splits
    for topic in tasks.TOPICS:
        mean_len = [
            np.mean([len(p.prompt) for p in train if p.topic == topic and p.difficulty == d])
            for d in tasks.DIFFICULTIES
        ]
        assert mean_len == sorted(mean_len), (topic, mean_len)


def test_bad_generator_arguments_raise():
    with pytest.raises(ValueError, match="division"):
        tasks.make_splits(0, topics=("division",))
    with pytest.raises(ValueError, match="difficulty"):
        tasks.make_splits(0, difficulties=(4,))


def test_one_make_splits_whose_default_counts_are_the_configs():
    from ebpo_jax import schema
    from ebpo_jax.tasks import guess, reasoning, splits

    for family in (tasks, reasoning, guess):
        assert family.make_splits.func is splits.make_splits
    _, test = reasoning.make_splits(0, topics=("chain",), difficulties=(1,))
    train, _ = guess.make_splits(0, topics=("small",), difficulties=(1,))
    assert (len(test), len(train)) == (schema.Task().test_per_cell, schema.Task().train_per_cell)


def test_tokenizer_round_trip_and_batch(splits):
    train, _ = splits
    assert (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2)
    assert TOK.vocab_size == len(tasks.tokenizer.DEFAULT_ALPHABET) + 3
    for p in train[:50]:
        text = p.prompt + p.answer
        ids = TOK.encode(text, add_bos=True, add_eos=True)
        assert ids[0] == BOS_ID and ids[-1] == EOS_ID
        assert TOK.decode(ids) == text
    texts = ["12+7=", "3", ""]
    tokens, lengths = TOK.encode_batch(texts, add_eos=True, length=8)
    assert tokens.dtype == np.int32 and lengths.dtype == np.int32 and tokens.shape == (3, 8)
    np.testing.assert_array_equal(lengths, [6, 2, 1])
    assert (tokens[0, 6:] == PAD_ID).all()
    assert TOK.decode_batch(tokens, lengths) == texts
    with pytest.raises(ValueError, match="'x'"):
        TOK.encode("1x")
    with pytest.raises(ValueError, match="length=3"):
        TOK.encode_batch(["12+7="], length=3)


def _check_rewards(completions, lengths, answers):
    """The jitted array reward equals the host string reward on every row."""
    ans_tok, ans_len = TOK.encode_batch(answers)
    jit_r = jax.jit(tasks.reward_fn)(completions, lengths, ans_tok, ans_len)
    assert jit_r.dtype == np.float32
    host_r = [tasks.host_reward(TOK, c[:n], a) for c, n, a in zip(completions, lengths, answers)]
    np.testing.assert_array_equal(np.asarray(jit_r), host_r)
    return np.asarray(jit_r)


def _completion_rows(texts_eos, width):
    """Right-padded completions from (text, ends_with_eos) pairs; lengths include the EOS."""
    rows = [TOK.encode(t, add_eos=eos) for t, eos in texts_eos]
    out = np.zeros((len(rows), width), np.int32)
    for b, r in enumerate(rows):
        out[b, : len(r)] = r
    return out, np.array([len(r) for r in rows], np.int32)


def test_reward_adversarial_cases():
    answer = "19"
    cases = [
        (("19", True), 1.0),  # exact, stops
        (("19", False), 0.0),  # missing EOS (truncated)
        (("1", True), 0.0),  # prefix of the answer
        (("190", True), 0.0),  # answer followed by junk
        (("", True), 0.0),  # empty completion
        (("", False), 0.0),  # nothing at all
        (("91", True), 0.0),
        (("019", True), 0.0),
    ]
    comp, lens = _completion_rows([c for c, _ in cases], width=6)
    r = _check_rewards(comp, lens, [answer] * len(cases))
    np.testing.assert_array_equal(r, [want for _, want in cases])
    # Junk after the EOS or beyond the length does not matter; a pad token inside does.
    comp2 = np.array([[4, 12, EOS_ID, 7, 7, 7], [4, 12, 7, 7, 7, 7], [4, PAD_ID, 12, EOS_ID, 0, 0]])
    r2 = _check_rewards(comp2.astype(np.int32), np.array([6, 2, 4], np.int32), [answer] * 3)
    np.testing.assert_array_equal(r2, [1.0, 0.0, 0.0])
    # Completions shorter than the answer padding width still work (N < A + 1).
    r3 = _check_rewards(np.array([[4, EOS_ID]], np.int32), np.array([2]), ["1234"])
    np.testing.assert_array_equal(r3, [0.0])
    r4 = tasks.reward_fn(comp[:2], lens[:2], *TOK.encode_batch([answer] * 2), require_eos=False)
    np.testing.assert_array_equal(r4, [1.0, 1.0])


def test_reward_random_cases_match_host(splits):
    train, _ = splits
    rng = np.random.default_rng(0)
    problems = [train[i] for i in rng.integers(0, len(train), 256)]
    answers = [p.answer for p in problems]
    texts = []
    for a in answers:  # mostly near-misses of the answer, so both outcomes occur often
        kind = rng.integers(4)
        if kind == 0:
            texts.append((a, True))
        elif kind == 1:
            texts.append((a[: rng.integers(len(a) + 1)], bool(rng.integers(2))))
        elif kind == 2:
            texts.append((a + "".join(rng.choice(list("0123=")) for _ in range(2)), True))
        else:
            texts.append(("".join(rng.choice(list("0123456789<>=")) for _ in range(2)), True))
    comp, lens = _completion_rows(texts, width=7)
    # Random junk (any vocab id, incl. EOS) after each completion's length must be ignored.
    junk = rng.integers(0, TOK.vocab_size, comp.shape).astype(np.int32)
    comp = np.where(np.arange(7)[None] < lens[:, None], comp, junk)
    r = _check_rewards(comp, lens, answers)
    assert 0.2 < r.mean() < 0.8
    # Fully random token rows (multiple EOS, pads, BOS) agree as well.
    comp_rand = rng.integers(0, TOK.vocab_size, (256, 5)).astype(np.int32)
    _check_rewards(comp_rand, rng.integers(0, 6, 256).astype(np.int32), answers)


def test_group_reward_is_prompt_major(splits):
    train, _ = splits
    batch = tasks.encode_problems(train[:3], TOK)
    # Prompt 1's second sample is its answer + EOS; everything else is the empty completion.
    comp = np.full((6, 5), EOS_ID, np.int32)
    n = batch.answer_lengths[1]
    comp[3, :n], comp[3, n] = batch.answer_tokens[1, :n], EOS_ID
    lens = np.ones(6, np.int32)
    lens[3] = n + 1
    r_PG = jax.jit(tasks.group_reward_fn, static_argnums=4)(
        comp, lens, batch.answer_tokens, batch.answer_lengths, 2
    )
    np.testing.assert_array_equal(r_PG, [[0, 0], [0, 1], [0, 0]])
    with pytest.raises(ValueError, match="group_size 4"):
        tasks.group_reward_fn(comp, lens, batch.answer_tokens, batch.answer_lengths, 4)


def test_reward_rejects_bad_shapes():
    with pytest.raises(ValueError, match="completion"):
        tasks.reward_fn(np.zeros((2, 3)), np.zeros(2), np.zeros((3, 2)), np.zeros(3))


def test_prompt_source_shapes_and_resume(splits):
    train, _ = splits
    src = tasks.PromptSource(train, TOK, 16, seed=3)
    batches = [src.next_batch() for _ in range(5)]
    b = batches[0]
    assert b.prompt_tokens.shape == (16, src.prompt_len) and b.prompt_tokens.dtype == np.int32
    assert b.answer_tokens.shape == (16, src.answer_len)
    for i, k in enumerate(b.index):
        p = train[k]
        assert TOK.decode(b.prompt_tokens[i, : b.prompt_lengths[i]]) == p.prompt
        assert b.prompt_tokens[i, 0] == BOS_ID
        assert TOK.decode(b.answer_tokens[i, : b.answer_lengths[i]]) == p.answer
        assert (b.topic_ids[i], b.difficulty[i]) == (p.topic_id, p.difficulty)
    state = src.state()
    after = [src.next_batch() for _ in range(3)]
    resumed = tasks.PromptSource(train, TOK, 16, seed=3)
    resumed.restore(state)
    for x, y in zip(after, [resumed.next_batch() for _ in range(3)]):
        for fx, fy in zip(x, y):
            np.testing.assert_array_equal(fx, fy)
    with pytest.raises(ValueError, match="data state"):
        resumed.restore({"epoch": 0, "position": len(train)})
    with pytest.raises(ValueError, match="other problems"):
        tasks.PromptSource(train, TOK, 16, seed=4).restore(state)


def test_prompt_source_epochs_cover_everything_and_reshuffle(splits):
    train, _ = splits
    n = len(train)
    src = tasks.PromptSource(train, TOK, 7, seed=0)  # 7 does not divide n: batches straddle epochs
    idx = np.concatenate([src.next_indices() for _ in range(-(-2 * n // 7))])
    np.testing.assert_array_equal(np.sort(idx[:n]), np.arange(n))
    np.testing.assert_array_equal(np.sort(idx[n : 2 * n]), np.arange(n))
    assert not np.array_equal(idx[:n], idx[n : 2 * n])
    stacked = tasks.PromptSource(train, TOK, 7, seed=0).next_batches(3)
    assert stacked.prompt_tokens.shape[:2] == (3, 7)
    np.testing.assert_array_equal(stacked.index.reshape(-1), idx[:21])


@pytest.mark.parametrize("order,field", [("topic", "topic_id"), ("difficulty", "difficulty")])
def test_sorted_orders(splits, order, field):
    train, _ = splits
    src = tasks.PromptSource(train, TOK, len(train), seed=0, order=order)
    keys = [getattr(train[i], field) for i in src.next_indices()]
    assert keys == sorted(keys)
    with pytest.raises(ValueError, match="order"):
        tasks.PromptSource(train, TOK, 4, order="random")


def test_sft_examples_mask_answer_and_eos(splits):
    train, _ = splits
    sft = tasks.sft_examples(train[:32], TOK)
    for p, row, mask, n in zip(train[:32], sft.tokens, sft.loss_mask, sft.lengths):
        assert TOK.decode(row[:n], stop_at_eos=False) == p.prompt + p.answer
        assert row[0] == BOS_ID and row[n - 1] == EOS_ID and (row[n:] == PAD_ID).all()
        assert TOK.decode(row[mask], stop_at_eos=False) == p.answer
        assert row[mask][-1] == EOS_ID and mask.sum() == len(p.answer) + 1


def test_eval_batch_scores_gold_answers(splits):
    _, test = splits
    batch = tasks.encode_problems(test, TOK)
    gold = np.concatenate([batch.answer_tokens, np.zeros_like(batch.answer_tokens[:, :1])], 1)
    gold[np.arange(len(test)), batch.answer_lengths] = EOS_ID
    r = tasks.reward_fn(gold, batch.answer_lengths + 1, batch.answer_tokens, batch.answer_lengths)
    assert np.asarray(r).tolist() == [1.0] * len(test)
