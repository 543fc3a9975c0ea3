"""The data stage on Ray Data, end to end on smoke-sized data (real Ray, real tokenizer)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from conftest import SMOKE, smoke_config
from pipeline import storage
from pipeline.errors import DataError
from pipeline.runner import build_plan, run_pipeline
from stages.common import tasks

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 12}


@pytest.fixture(scope="module")
def run_dir(smoke_upstream, tmp_path_factory):
    """Seeded with the session's smoke model and data (the same keys as smoke.yaml here): the generated
    task's checks read that run, and every other run of this module reuses its model."""
    return smoke_upstream(tmp_path_factory.mktemp("data_runs"))


def run_data(run_dir, tracking_uri, *overrides) -> tuple[dict, dict]:
    """Run model + data; return (data outputs, data metrics)."""
    cfg = smoke_config(run_dir, f"mlflow.tracking_uri={tracking_uri}", *overrides)
    summary = run_pipeline(cfg, SMOKE, Console(quiet=True), to="data")
    manifest = summary["stages"]["data"]
    out = storage.artifact_dir(cfg.run_dir, "data", manifest["key"])
    return storage.output_paths(manifest, out), manifest["metrics"]


def read(path) -> list[dict]:
    files = sorted(path.glob("*.parquet"))
    return pq.ParquetDataset(files).read().to_pylist() if files else []


def test_generated_task_data(ray_local, run_dir, tracking_uri):
    outputs, m = run_data(run_dir, tracking_uri)
    cfg = smoke_config(run_dir)
    from stages.common.models import load_tokenizer

    tok = load_tokenizer(json.loads((outputs["sft_data"] / "meta.json").read_text())["tokenizer"])
    replies = {r["messages"][0]["content"]: r["messages"][1]["content"]
               for r in tasks.sft_rows(cfg.stages.data.generate.sft, cfg.seed, cfg.task)}

    # Only assistant replies are trained: the masked tokens decode to exactly the reply.
    sft = read(outputs["sft_data"] / "train") + read(outputs["sft_data"] / "eval")
    assert len(sft) == m["sft_train_rows"] + m["sft_eval_rows"] > 100
    for row in sft:
        trained = [t for t, keep in zip(row["input_ids"], row["loss_mask"]) if keep]
        assert tok.decode(trained, skip_special_tokens=True) == replies[row["prompt"]]
        assert len(row["input_ids"]) <= cfg.stages.data.max_len

    # Train and eval never share a prompt, within or across datasets.
    train, evals = set(), set()
    for name in ("sft_data", "preference_data", "prompt_data"):
        train |= {r["prompt"] for r in read(outputs[name] / "train")}
        evals |= {r["prompt"] for r in read(outputs[name] / "eval")}
    assert evals and train and not (train & evals)
    # ... nor a problem: the generated rows' `group` (the problem, in any wording) decides the split.
    group = {r["messages"][0]["content"]: r["group"] for r in tasks.sft_rows(200, cfg.seed, cfg.task)}
    group |= {r["prompt"]: r["group"] for r in tasks.preference_rows(100, cfg.seed, cfg.task)}
    group |= {r["prompt"]: r["group"] for r in tasks.prompt_rows(60, cfg.seed, cfg.task)}
    assert not ({group[p] for p in train} & {group[p] for p in evals})

    # Rows are written in a seeded shuffled order, not sorted by prompt (sorted batches of near-identical
    # problems kept SFT from learning): about half of the neighbouring pairs are in sorted order.
    order = [r["prompt"] for r in read(outputs["sft_data"] / "train")]
    in_order = sum(a <= b for a, b in zip(order, order[1:])) / (len(order) - 1)
    assert 0.25 < in_order < 0.75, in_order

    # Row accounting: every generated row is written, a duplicate or dropped, and counted.
    assert m["sft_train_rows"] + m["sft_eval_rows"] + m["sft_rows_duplicate"] + m["sft_rows_too_long"] == 200
    assert m["sft_rows_duplicate"] == 200 - len({json.dumps(r) for r in tasks.sft_rows(200, cfg.seed, cfg.task)})
    pref = read(outputs["preference_data"] / "train")
    assert all(tasks.verify(r["chosen"], str(tasks.extract_answer(r["chosen"]))) for r in pref)
    assert all(r["chosen_input_ids"] != r["rejected_input_ids"] for r in pref)
    prompts = read(outputs["prompt_data"] / "train")
    assert prompts and all(tok.decode(r["prompt_ids"]).endswith("<|im_start|>assistant\n") for r in prompts)
    assert m["sft_train_tokens"] == sum(len(r["input_ids"]) for r in read(outputs["sft_data"] / "train"))


def test_the_same_config_writes_the_same_files(ray_local, run_dir, tracking_uri, tmp_path):
    """Part files, not just rows, are identical across runs: training reads them in file order,
    and two runs that wrote the same rows with parts swapped trained SFT on another batch order."""
    first, _ = run_data(run_dir, tracking_uri)
    again, _ = run_data(tmp_path / "again", tracking_uri)
    assert parts(first) == parts(again)


def test_the_driver_dedupe_writes_what_ray_datas_groupby_writes(ray_local, run_dir, tracking_uri, tmp_path,
                                                                monkeypatch):
    """A small dataset is deduplicated in the driver (`stages.data._unique`, pyarrow), a large one by Ray
    Data's groupby: the same rows in the same part files, and the same counts, either way."""
    import stages.data

    first, counts = run_data(run_dir, tracking_uri)  # the module's run: the driver's dedupe
    monkeypatch.setattr(stages.data, "DRIVER_DEDUPE_MAX_BYTES", -1)  # every dataset "large"
    again, counts_again = run_data(tmp_path / "groupby", tracking_uri)
    assert counts["sft_rows_duplicate"] > 0  # something to drop
    assert parts(first) == parts(again)
    assert {k: v for k, v in counts.items() if "_rows" in k} == {k: v for k, v in counts_again.items() if "_rows" in k}


def parts(outputs) -> list:
    """Every part file's rows, per dataset and split, in file order."""
    return [[pq.read_table(f).to_pylist() for f in sorted((outputs[name] / split).glob("*.parquet"))]
            for name in ("sft_data", "preference_data", "prompt_data") for split in ("train", "eval")]


def _write_user_files(tmp_path):
    """20 valid rows per kind in three formats, plus duplicates and invalid rows."""
    sft = tmp_path / "sft.jsonl"
    good = [{"messages": [{"role": "user", "content": f"Say hi {i}"}, {"role": "assistant", "content": f"hi {i}"}]}
            for i in range(10)]
    good += [{"prompt": f"What is {i} + 1?", "response": f"{i} + 1 = {i + 1}"} for i in range(10)]
    sft.write_text("\n".join(json.dumps(r) for r in [
        *good[:3],
        {"messages": [{"role": "user", "content": "no reply"}]},  # line 4, invalid: no assistant turn
        good[0],  # duplicate
        {"prompt": "", "response": "x"},  # invalid: empty prompt
        *good[3:],
    ]) + "\n")
    pref = tmp_path / "pref.csv"
    pref.write_text("prompt,chosen,rejected\n" + "".join(f"What is {i} + 2?,{i + 2},{i + 3}\n" for i in range(20))
                    + "Same?,same,same\n")
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": [f"What is {i} + 4?" for i in range(20)],
                             "answer": [str(i + 4) for i in range(20)]}),
                   prompts)
    return sft, pref, prompts


def _write_malformed(tmp_path):
    """20 valid SFT rows and, on line 3, a line that is not JSON."""
    bad = tmp_path / "broken.jsonl"
    good = [json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) for i in range(20)]
    bad.write_text("\n".join([*good[:2], '{"prompt": oops}', *good[2:]]) + "\n")
    return bad


def test_user_files_with_bad_rows_and_malformed_lines_dropped_and_counted(ray_local, run_dir, tracking_uri, tmp_path):
    """One data run for every kind's user files (issue 58: the user-file scenarios share their runs): invalid
    rows, a duplicate and a line that is not JSON are dropped and counted, the rest written."""
    sft, pref, prompts = _write_user_files(tmp_path)
    broken = _write_malformed(tmp_path)
    unpaired = tmp_path / "unpaired.jsonl"  # KTO's data: completions labelled desirable or undesirable
    unpaired.write_text("".join(json.dumps({"prompt": f"What is {i} + 5?", "completion": str(i + 5 + i % 2),
                                            "label": i % 2 == 0}) + "\n" for i in range(6)))
    outputs, m = run_data(run_dir, tracking_uri, f"stages.data.sources.sft=[{sft}, {broken}]",
                          f"stages.data.sources.preference=[{pref}, {unpaired}]",
                          f"stages.data.sources.prompts=[{prompts}]", "stages.data.eval_fraction=0.3")
    # sft.jsonl: 2 invalid rows and 1 duplicate of its 20; broken.jsonl: 1 line that is not JSON of its 20
    assert (m["sft_rows_bad"], m["sft_rows_duplicate"], m["sft_train_rows"] + m["sft_eval_rows"]) == (3, 1, 40)
    assert m["sft_rows_bad_invalid_json"] == 1
    assert (m["preference_rows_bad"], m["preference_train_rows"] + m["preference_eval_rows"]) == (1, 26)
    meta = json.loads((outputs["preference_data"] / "meta.json").read_text())
    assert m["preference_train_unpaired"] + m["preference_eval_unpaired"] == sum(meta["unpaired"].values()) == 6
    # the stages that train on pairs refuse unpaired rows before any work, naming the fix
    from types import SimpleNamespace

    from pipeline.errors import UserError
    from stages import dpo, reward

    ctx = SimpleNamespace(inputs={"preference_data": outputs["preference_data"], "sft_model": tmp_path})
    with pytest.raises(UserError, match="6 preference rows are unpaired .* stages.dpo \\(loss: kto\\)"):
        reward.run(reward.RewardConfig(), ctx)
    with pytest.raises(UserError, match="which loss dpo cannot train on; set stages.dpo.loss: kto"):
        dpo.run(dpo.DPOConfig(), ctx)
    assert m["prompts_rows_bad"] == 0 and m["prompts_train_rows"] + m["prompts_eval_rows"] == 20
    assert min(m[f"{k}_{s}_rows"] for k in ("sft", "preference", "prompts") for s in ("train", "eval")) > 0
    rows = read(outputs["prompt_data"] / "train") + read(outputs["prompt_data"] / "eval")
    assert sorted(int(r["answer"]) for r in rows) == list(range(4, 24))


def test_fail_mode_names_the_file_and_line(ray_local, run_dir, tracking_uri, tmp_path):
    sft, _, _ = _write_user_files(tmp_path)
    with pytest.raises(DataError, match=rf"{sft}: line 4: no non-empty assistant message.*2 invalid rows"):
        run_data(run_dir, tracking_uri, f"stages.data.sources.sft=[{sft}]", "stages.data.on_bad_rows=fail")


def test_fail_mode_names_a_malformed_line(ray_local, run_dir, tracking_uri, tmp_path):
    bad = _write_malformed(tmp_path)  # dropped and counted in the shared user-files run above
    with pytest.raises(DataError, match=rf"{bad}: line 3: invalid JSON"):
        run_data(run_dir, tracking_uri, f"stages.data.sources.sft=[{bad}]", "stages.data.on_bad_rows=fail")


def test_packing_keeps_every_trained_token(ray_local, run_dir, tracking_uri):
    plain, m_plain = run_data(run_dir, tracking_uri)
    packed, m_packed = run_data(run_dir, tracking_uri, "stages.data.pack=true")
    rows_plain, rows_packed = read(plain["sft_data"] / "train"), read(packed["sft_data"] / "train")
    assert len(rows_packed) < len(rows_plain)
    assert sum(map(sum, (r["loss_mask"] for r in rows_packed))) == sum(map(sum, (r["loss_mask"] for r in rows_plain)))
    assert m_packed["sft_train_tokens"] == m_plain["sft_train_tokens"]
    assert all(len(r["input_ids"]) == len(r["position_ids"]) <= 64 for r in rows_packed)
    assert sum(p == 0 for r in rows_packed for p in r["position_ids"]) == len(rows_plain)


def test_a_local_checkpoint_replaces_the_builtin_model(ray_local, tmp_path, tracking_uri):
    """`model.source: /path` goes through the same from_pretrained path; its files are in the key."""
    from stages.common import models

    cfg = smoke_config(tmp_path)
    ckpt = models.build_base_model(tmp_path / "my-checkpoint", cfg.model.builtin,
                                   tasks.corpus(cfg.task, 7) + ["a user corpus"], seed=7)
    outputs, m = run_data(tmp_path / "run", tracking_uri, f"model.source={ckpt}")
    meta = json.loads((outputs["sft_data"] / "meta.json").read_text())
    assert meta["tokenizer"] == str(ckpt)  # used in place, not copied
    assert m["sft_train_rows"] > 0

    cfg = smoke_config(tmp_path / "run", f"model.source={ckpt}", f"mlflow.tracking_uri={tracking_uri}")
    assert {p.spec.name: p.status for p in build_plan(cfg, to="data") if p.status != "skip"} == \
        {"model": "hit", "data": "hit"}
    (ckpt / "config.json").write_text((ckpt / "config.json").read_text().replace("}", ', "note": 1}', 1))
    plan = {p.spec.name: p for p in build_plan(cfg, to="data")}
    assert plan["model"].status == "miss" and "raw inputs changed" in plan["model"].reason
    assert plan["data"].status == "miss"


# smoke.yaml asks for generated rows of every kind; unset, a kind with the user's sources gets none.
UNSET_GENERATE = ("stages.data.generate.sft=null", "stages.data.generate.preference=null",
                  "stages.data.generate.prompts=null")


def _fifty_conversations():
    """50 single-turn conversations with a system prompt (the shape every SFT format can carry)."""
    return [("Answer in one word.", f"Name colour number {i}?", f"colour{i}") for i in range(50)]


# The capital-city task of the eval-set scenario: training prompts, and the user's held-out set, two of
# whose prompts are also in the training files.
CAPITALS = [{"prompt": f"Capital of country {i}?", "answer": f"city{i}"} for i in range(30)]
HELD_OUT = [{"question": f"Capital of country {i}?", "final": f"city{i}"} for i in (3, 7)] + \
    [{"question": f"Capital of island {i}?", "final": f"port{i}"} for i in range(8)]


@pytest.fixture(scope="module")
def user_formats(ray_local, run_dir, tracking_uri, tmp_path_factory):
    """One data run (issue 58: the user-file scenarios share their runs) of the same 50 conversations in three
    SFT formats, RL prompts saved by `datasets`, and the capital-city task with its own held-out set:
    (data outputs, data metrics)."""
    import gzip

    import datasets

    tmp_path = tmp_path_factory.mktemp("user_formats")
    convs = _fifty_conversations()
    messages = tmp_path / "chats.jsonl.gz"
    with gzip.open(messages, "wt") as f:
        for system, user, reply in convs:
            f.write(json.dumps({"messages": [{"role": "system", "content": system}, {"role": "user", "content": user},
                                             {"role": "assistant", "content": reply}]}) + "\n")
        f.write('{"messages": [{"role": "user", "content": "cut off\n')  # invalid JSON: dropped, counted
        f.write(json.dumps({"messages": [{"role": "user",
                                          "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]},
                                         {"role": "assistant", "content": "a cat"}]}) + "\n")  # an image: refused
    shards = tmp_path / "sharegpt"
    shards.mkdir()
    for part in range(2):
        rows = [{"conversations": [{"from": "system", "value": s}, {"from": "human", "value": u},
                                   {"from": "gpt", "value": r}]}
                for s, u, r in convs[part * 25:(part + 1) * 25]]
        pq.write_table(pa.Table.from_pylist(rows), shards / f"part-{part}.parquet")
    alpaca = tmp_path / "alpaca.csv"
    alpaca.write_text("system,instruction,input,output\n" + "".join(f"{s},{u},,{r}\n" for s, u, r in convs))
    # RL prompts the way a `datasets` user saves them: a DatasetDict, their own column names, an extra column.
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({
        "question": [u for _, u, _ in convs], "final": [r for _, _, r in convs], "level": list(range(50))})}
    ).save_to_disk(str(tmp_path / "rl"))
    rl = f"{{path: {tmp_path / 'rl'}, split: test, columns: {{prompt: question, answer: final}}}}"
    capitals_sft = [{"messages": [{"role": "user", "content": r["prompt"]},
                                  {"role": "assistant", "content": r["answer"]}]}
                    for r in CAPITALS]
    for name, rows in (("capitals", CAPITALS), ("held_out", HELD_OUT), ("capitals_sft", capitals_sft)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out = f"{{path: {tmp_path / 'held_out.jsonl'}, columns: {{prompt: question, answer: final}}}}"
    return run_data(run_dir, tracking_uri, *UNSET_GENERATE,
                    f"stages.data.sources.sft=[{messages}, {shards}, {alpaca}, {tmp_path / 'capitals_sft.jsonl'}]",
                    f"stages.data.sources.prompts=[{rl}, {tmp_path / 'capitals.jsonl'}]",
                    f"stages.data.sources.eval=[{held_out}]")


def test_the_same_conversations_in_every_format_write_the_same_rows(user_formats):
    """OpenAI messages (JSON Lines, gzipped), ShareGPT (a directory of Parquet shards) and Alpaca (CSV)
    are recognised by their columns and become identical rows (so the second and third copies are counted
    as duplicates of the first, and 50 rows are written, not 100 or 150); a user's data is not topped up
    with generated arithmetic; rows that cannot be used are dropped and counted per reason."""
    outputs, m = user_formats
    convs = _fifty_conversations()
    users = {u for _, u, _ in convs}
    sft = [r for split in ("train", "eval") for r in read(outputs["sft_data"] / split) if r["prompt"] in users]
    assert len(sft) == 50 and {r["prompt"] for r in sft} == users
    assert m["sft_rows_duplicate"] == 100  # each format's 50 rows are the same 50 rows
    assert (m["sft_rows_bad"], m["sft_rows_bad_invalid_json"], m["sft_rows_bad_non_text_content"]) == (2, 1, 1)
    assert m["preference_train_rows"] + m["preference_eval_rows"] == 0  # nothing generated unasked
    rl = [r for split in ("train", "eval") for r in read(outputs["prompt_data"] / split) if r["prompt"] in users]
    assert sorted((r["prompt"], r["answer"], json.loads(r["extra"])["level"]) for r in rl) == sorted(
        (u, r, i) for i, (_, u, r) in enumerate(convs))


def test_a_users_eval_set_is_the_evaluation_and_kept_out_of_training(user_formats):
    """`sources.eval`: the user's held-out prompts become the prompts' eval split exactly; a training row of
    any kind that shares a prompt with them is held out (sft to its eval split, RL prompts not written)."""
    outputs, m = user_formats
    held = {r["question"] for r in HELD_OUT}
    assert {r["prompt"] for r in read(outputs["prompt_data"] / "eval")} == held
    capitals = {r["prompt"] for r in CAPITALS}
    train = {r["prompt"] for r in read(outputs["prompt_data"] / "train")}
    assert train & capitals == capitals - held and m["prompts_rows_in_eval_set"] == 2
    assert not ({r["prompt"] for r in read(outputs["sft_data"] / "train")} & held)
