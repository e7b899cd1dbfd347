"""A run records a digest of every input file it reads (a prompt file, a local corpus file, a plan file) in its
run marker, and refuses to resume on one that changed since, in one line naming the file and --overwrite (issue
54: a prompt file edited in place, same ids and new answers, was scored by the records of the old answers)."""

from __future__ import annotations

import json

from kveval.results.layout import MARKER_FILE


def _gen_config(h, tmp_path, prompts, **extra):
    raw = h.tiny_raw(tmp_path / "out", tasks=[{"generation": {"prompts": str(prompts), "max_new_tokens": 3,
                                                               "examples": 0, "plots": False}}], **extra)
    return h.write_config(tmp_path / "c.yaml", raw)


def _write_prompts(path, answer: str):
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Say {i}.", "answer": answer,
                                        "checker": "exact"}) + "\n" for i in range(2)))


def test_a_prompt_file_edited_in_place_is_not_resumed(h, tmp_path):
    prompts = tmp_path / "p.jsonl"
    _write_prompts(prompts, "a")
    config = _gen_config(h, tmp_path, prompts)
    first = h.invoke("run", config, "--quiet")
    assert first.exit_code == 0, first.output
    out = tmp_path / "out"
    marker = json.loads((out / MARKER_FILE).read_text())
    assert marker["inputs"]["tasks[0].generation.prompts"]["path"] == str(prompts)
    records = (out / "records.jsonl").read_text()

    _write_prompts(prompts, "b")  # same ids, other answers
    line = h.assert_user_error(h.invoke("run", config, "--quiet"), str(prompts), "tasks[0].generation.prompts",
                               "changed", "--overwrite")
    assert str(out) in line
    assert (out / "records.jsonl").read_text() == records  # nothing lost

    again = h.invoke("run", config, "--quiet", "--overwrite")  # starts afresh on the new file
    assert again.exit_code == 0, again.output
    marker = json.loads((out / MARKER_FILE).read_text())
    assert marker["inputs"]["tasks[0].generation.prompts"]["sha256"] != ""
    resumed = h.invoke("run", config, "--quiet")  # the same file again: resumes
    assert resumed.exit_code == 0, resumed.output


def test_a_local_corpus_file_edited_in_place_is_not_resumed(h, tmp_path):
    prompts = tmp_path / "p.jsonl"
    _write_prompts(prompts, "a")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text of a corpus\n" * 40)
    config = _gen_config(h, tmp_path, prompts, data={"source": str(corpus)})
    assert h.invoke("run", config, "--quiet").exit_code == 0
    corpus.write_text("other text of a corpus\n" * 40)
    h.assert_user_error(h.invoke("run", config, "--quiet"), str(corpus), "changed", "--overwrite")


def test_input_files_names_what_a_config_reads(tmp_path):
    from kveval.config import input_files, validate

    prompts = tmp_path / "p.jsonl"
    _write_prompts(prompts, "a")
    corpus = tmp_path / "c.txt"
    corpus.write_text("text\n" * 10)
    cfg = validate({"name": "t", "model": "builtin:tiny-llama", "data": {"source": str(corpus)}, "kv": ["int8"],
                    "tasks": [{"perplexity": {"seq_len": 8, "max_tokens": 16}},
                              {"generation": {"prompts": str(prompts)}}, {"generation": {}}]})
    assert input_files(cfg) == {"data": str(corpus), "tasks[1].generation.prompts": str(prompts)}


def test_a_folder_made_before_inputs_were_recorded_adopts_them(h, tmp_path):
    prompts = tmp_path / "p.jsonl"
    _write_prompts(prompts, "a")
    config = _gen_config(h, tmp_path, prompts)
    assert h.invoke("run", config, "--quiet").exit_code == 0
    marker_path = tmp_path / "out" / MARKER_FILE
    marker = json.loads(marker_path.read_text())
    del marker["inputs"]
    marker_path.write_text(json.dumps(marker))
    assert h.invoke("run", config, "--quiet").exit_code == 0
    assert "inputs" in json.loads(marker_path.read_text())


def test_a_plan_file_edited_in_place_is_not_resumed(h, tmp_path):
    from test_inputs_plan import _scan

    planned = h.invoke("plan", _scan(tmp_path / "scan"), "--budget", "int4_g32", "-o", tmp_path / "gen" / "p.yaml")
    assert planned.exit_code == 0, planned.output
    config, side = tmp_path / "gen" / "p.yaml", tmp_path / "gen" / "p.plan.json"
    out = tmp_path / "run"
    first = h.invoke("run", config, "-s", f"output={out}", "-s", "tasks[0].perplexity.max_tokens=96", "--quiet")
    assert first.exit_code == 0, first.output
    assert json.loads((out / MARKER_FILE).read_text())["inputs"]["plan"]["path"] == str(side)
    data = json.loads(side.read_text())
    data["predicted_kld_sum"] = float(data["predicted_kld_sum"]) * 2  # valid, and another plan's prediction
    side.write_text(json.dumps(data))
    h.assert_user_error(h.invoke("run", config, "-s", f"output={out}", "-s", "tasks[0].perplexity.max_tokens=96",
                                 "--quiet"), str(side), "changed", "--overwrite")


def test_a_session_file_edited_in_place_is_not_resumed(h, tmp_path):
    sessions = tmp_path / "s.jsonl"
    turn = {"user": "What is 2 plus 2?", "answer": "4", "checker": "number"}
    sessions.write_text(json.dumps({"id": "s1", "turns": [turn]}) + "\n")
    raw = {"name": "s", "model": "builtin:smollm2-135m", "data": "builtin", "kv": ["int8"],
           "output": str(tmp_path / "out"), "tasks": [{"session": {"sessions": str(sessions), "max_new_tokens": 2}}]}
    config = h.write_config(tmp_path / "c.yaml", raw)
    first = h.invoke("run", config, "--quiet")
    assert first.exit_code == 0, first.output
    sessions.write_text(json.dumps({"id": "s1", "turns": [{**turn, "answer": "5"}]}) + "\n")  # same id, new answer
    h.assert_user_error(h.invoke("run", config, "--quiet"), str(sessions), "tasks[0].session.sessions", "changed")
