"""Bad input and reused PIDs end in one line naming the place, never in a silent wrong result: the workdir lock's
staleness (PID start times, heartbeat age), predict's output path, and the typed fields of every task reader
(GLUE TSV and JSON lines, SQuAD JSON, SWAG CSV, CoNLL and token JSON lines)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import types

import pytest

from bert_jax import cli
from bert_jax.tasks import predict as predict_lib
from bert_jax.tasks.registry import get_task
from bert_jax.train import workdir as workdir_lib

OWN_START = workdir_lib._process_start(os.getpid())
needs_start_times = pytest.mark.skipif(OWN_START is None, reason="no /proc process start times on this system")


# The workdir lock.

def _write_lock(workdir, age: float = 0.0, **fields) -> None:
  """A lock file as a holder of this host would have left it, its heartbeat `age` seconds old."""
  now = time.time()
  record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": OWN_START, "started": now - age - 5,
            "heartbeat": now - age, "token": "holder", **fields}
  (workdir / workdir_lib.LOCK_FILE).write_text(json.dumps(record))


def _lock_token(workdir) -> str:
  return json.loads((workdir / workdir_lib.LOCK_FILE).read_text())["token"]


@pytest.fixture
def live_pid():
  """The PID of a live process other than this one."""
  process = subprocess.Popen(["sleep", "60"])
  yield process.pid
  process.kill()
  process.wait()


def _taken_over(workdir, caplog, reason: str) -> None:
  with workdir_lib.WorkdirLock.acquire(workdir) as lock:
    held = json.loads((workdir / workdir_lib.LOCK_FILE).read_text())
    assert held["token"] == lock.record["token"] != "holder"
    assert (held["pid"], held["pid_start"]) == (os.getpid(), OWN_START)
  assert reason in caplog.text


@needs_start_times
@pytest.mark.parametrize("age, reason", [(0, "now belongs to another process"), (600, "not been heard from for 600 s")])
def test_lock_whose_pid_now_belongs_to_another_process_is_taken_over(tmp_path, caplog, live_pid, age, reason):
  _write_lock(tmp_path, age, pid=live_pid, pid_start=f"{OWN_START.split(':')[0]}:1")
  _taken_over(tmp_path, caplog, reason)


@needs_start_times
@pytest.mark.parametrize("age, reason", [(0, "is now this run's"), (600, "not been heard from for 600 s")])
def test_lock_whose_pid_is_this_run_is_taken_over(tmp_path, caplog, age, reason):
  # A restarted container: the dead holder was PID N, and so is this run; its start time tells them apart.
  _write_lock(tmp_path, age, pid_start=f"{OWN_START.split(':')[0]}:1")
  _taken_over(tmp_path, caplog, reason)


def test_live_pid_with_a_stopped_heartbeat_is_taken_over_on_the_same_host(tmp_path, caplog, live_pid):
  # Written by a version that recorded no start time: the heartbeat's age decides.
  _write_lock(tmp_path, 600, pid=live_pid, pid_start=None)
  _taken_over(tmp_path, caplog, "not been heard from for 600 s")


@pytest.mark.parametrize("pid", [None, -1, 0, "x"])
def test_lock_without_a_valid_pid_is_unreadable_and_taken_over(tmp_path, caplog, pid):
  _write_lock(tmp_path, pid=pid)
  _taken_over(tmp_path, caplog, "the lock file is unreadable")


def test_live_holder_with_a_fresh_heartbeat_is_refused(tmp_path, live_pid):
  _write_lock(tmp_path, 10, pid=live_pid, pid_start=workdir_lib._process_start(live_pid))
  with pytest.raises(workdir_lib.WorkdirBusyError, match=rf"in use by another run \(host .*, pid {live_pid}, started"):
    workdir_lib.WorkdirLock.acquire(tmp_path)
  _write_lock(tmp_path, 10, pid=live_pid, pid_start=None)  # No start time recorded: the PID is all there is.
  with pytest.raises(workdir_lib.WorkdirBusyError):
    workdir_lib.WorkdirLock.acquire(tmp_path)
  assert _lock_token(tmp_path) == "holder"
  (tmp_path / workdir_lib.LOCK_FILE).unlink()
  with workdir_lib.WorkdirLock.acquire(tmp_path, heartbeat=0.05) as lock:  # This run's own live lock.
    time.sleep(0.2)
    with pytest.raises(workdir_lib.WorkdirBusyError, match=rf"pid {os.getpid()}"):
      workdir_lib.WorkdirLock.acquire(tmp_path, stale_after=1)
    assert _lock_token(tmp_path) == lock.record["token"]


def test_lock_from_another_host_is_stale_by_heartbeat_age(tmp_path, caplog):
  _write_lock(tmp_path, 60, host="another-host", pid=1, pid_start="boot:1")
  with pytest.raises(workdir_lib.WorkdirBusyError, match="host another-host, pid 1"):
    workdir_lib.WorkdirLock.acquire(tmp_path)
  _write_lock(tmp_path, 600, host="another-host", pid=1, pid_start="boot:1")
  _taken_over(tmp_path, caplog, "not been heard from for 600 s")


# bert-jax predict: one line through the CLI, before any model is loaded where the check allows.

def _predict(capsys, input_path, output_path, workdir="no-such-run") -> tuple[int, str]:
  code = cli.main(["predict", "--workdir", str(workdir), "--input", str(input_path), "--output", str(output_path)])
  err = capsys.readouterr().err
  assert "Traceback" not in err
  return code, err


@pytest.fixture
def no_model(monkeypatch):
  """predict with the model of a task but no parameters: the input is read and refused before any is needed."""
  def load(task_name):
    monkeypatch.setattr(predict_lib, "load_for_inference", lambda *_: types.SimpleNamespace(task=get_task(task_name)))
  monkeypatch.setattr(predict_lib, "load_for_inference", lambda *_: pytest.fail("loaded a model"))
  return load


def test_predict_refuses_to_overwrite_its_input(tmp_path, capsys, no_model):
  source = tmp_path / "reviews.jsonl"
  text = '{"sentence": "a fine film"}\n'
  source.write_text(text)
  os.link(source, tmp_path / "hard.jsonl")
  (tmp_path / "soft.jsonl").symlink_to(source)
  (tmp_path / "sub").mkdir()
  for output in (source, tmp_path / "sub" / ".." / "reviews.jsonl", tmp_path / "hard.jsonl", tmp_path / "soft.jsonl"):
    code, err = _predict(capsys, source, output)
    assert code == 1
    assert err.strip().count("\n") == 0
    assert f"--output {output} is the input file {source}" in err and "choose another --output" in err
    assert source.read_text() == text


def _lines(*records) -> str:
  return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


@pytest.mark.parametrize("value, shown", [(None, "null"), (5, "the number 5"), (["a"], "a list")])
def test_predict_refuses_non_text_fields_with_file_and_line(tmp_path, capsys, no_model, value, shown):
  source = tmp_path / "pairs.jsonl"
  source.write_text(_lines({"sentence1": "a", "sentence2": "b"}, {"sentence1": "a", "sentence2": value}))
  no_model("glue/rte")
  code, err = _predict(capsys, source, tmp_path / "out.jsonl")
  assert code == 1
  assert err.strip() == (f"bert-jax predict: error: {source}:2: field 'sentence2' is {shown}, expected a string (the "
                         "text); fix or remove that line")
  assert not (tmp_path / "out.jsonl").exists()


_SQUAD_QUESTION = {"id": "q1", "question": "what?", "answers": [{"text": "ctx", "answer_start": 0}]}


def _squad(**changes) -> dict:
  """SQuAD JSON of one question, with `changes` at the article ("paragraphs"), paragraph ("context", "qas"),
  question ("question", "id", "is_impossible", "answers") or answer ("answer_start", "text") level."""
  def pick(*keys):
    return {key: value for key, value in changes.items() if key in keys}
  answer = {**_SQUAD_QUESTION["answers"][0], **pick("answer_start", "text")}
  question = {**_SQUAD_QUESTION, "answers": [answer], **pick("question", "id", "is_impossible", "answers")}
  paragraph = {"context": "ctx here", "qas": [question], **pick("context", "qas")}
  article = {"title": "t", "paragraphs": [paragraph], **pick("paragraphs")}
  return {"version": "1.1", "data": [{"title": "first", "paragraphs": []}, article]}


SWAG_HEADER = ",video-id,fold-ind,startphrase,sent1,sent2,gold-source,ending0,ending1,ending2,ending3,label"
SWAG_ROW = "0,v,7,s,He sits.,He,gold,a,b,c,d,"  # The label left to append.

# (task, file name, contents, the message after "FILE" (":LINE: ..." or ": ..."))
PREDICT_CASES = {
    "squad paragraphs null": ("squad/v1.1", "dev.json", _squad(paragraphs=None),
                              ": data[1].paragraphs is null, expected a list; fix that field of the file"),
    "squad context number": ("squad/v1.1", "dev.json", _squad(context=5),
                             ": data[1].paragraphs[0].context is the number 5, expected a string"),
    "squad answer_start text": ("squad/v1.1", "dev.json", _squad(answer_start="abc"),
                                ": data[1].paragraphs[0].qas[0].answers[0].answer_start is the string 'abc', "
                                "expected an integer"),
    "squad answer_start true": ("squad/v1.1", "dev.json", _squad(answer_start=True),
                                ": data[1].paragraphs[0].qas[0].answers[0].answer_start is true, expected an integer"),
    "squad answer text null": ("squad/v1.1", "dev.json", _squad(text=None),
                               ": data[1].paragraphs[0].qas[0].answers[0].text is null, expected a string"),
    "squad question number": ("squad/v1.1", "dev.json", _squad(question=5),
                              ": data[1].paragraphs[0].qas[0].question is the number 5, expected a string"),
    "squad id number": ("squad/v1.1", "dev.json", _squad(id=7),
                        ": data[1].paragraphs[0].qas[0].id is the number 7, expected a string"),
    "squad is_impossible text": ("squad/v2.0", "dev.json", _squad(is_impossible="false"),
                                 ": data[1].paragraphs[0].qas[0].is_impossible is the string 'false', expected true "
                                 "or false"),
    "squad question null": ("squad/v1.1", "dev.json", _squad(qas=[None]),
                            ": data[1].paragraphs[0].qas[0] is null, expected an object"),
    "squad qas object": ("squad/v1.1", "dev.json", _squad(qas={"id": "q1"}),
                         ": data[1].paragraphs[0].qas is an object, expected a list"),
    "squad repeated id": ("squad/v1.1", "dev.json", _squad(qas=[_SQUAD_QUESTION, _SQUAD_QUESTION]),
                          ": question id 'q1' at data[1].paragraphs[0].qas[1] repeats the one at "
                          "data[1].paragraphs[0].qas[0]; give every question its own id"),
    "squad start outside": ("squad/v1.1", "dev.json", _squad(answer_start=50),
                            ": question q1: answer start 50 is outside the context "
                            "(data[1].paragraphs[0].qas[0].answers[0]: 3 characters from 50, context has 8)"),
    "glue line not object": ("glue/sst2", "in.jsonl", _lines({"sentence": "ok"}, "[1, 2]"),
                             ":2: the line is a list, expected a JSON object: sst2 lines are objects with"),
    "glue text null": ("glue/sst2", "in.jsonl", _lines({"sentence": None}),
                       ":1: field 'sentence' is null, expected a string"),
    "glue label list": ("glue/sst2", "in.jsonl", _lines({"sentence": "x", "label": [1]}),
                        ":1: field 'label' is a list, expected a label string, an index, a score"),
    "glue label true": ("glue/sst2", "in.jsonl", _lines({"sentence": "x", "label": True}),
                        ":1: field 'label' is true, expected"),
    "glue label outside": ("glue/sst2", "in.jsonl", _lines({"sentence": "x", "label": 2}),
                           ":1: label '2' is not one of ['0', '1'] (sst2)"),
    "stsb score text": ("glue/stsb", "in.jsonl", _lines({"sentence1": "x", "sentence2": "y", "label": "high"}),
                        ":1: score 'high' is not a number (stsb)"),
    "glue idx null": ("glue/sst2", "in.jsonl", _lines({"sentence": "x", "idx": None}),
                      ":1: field 'idx' is null, expected a string or an integer"),
    "glue not json": ("glue/sst2", "in.jsonl", '{"sentence": "x"}\n{"sentence": \n',
                      ":2: not JSON (Expecting value); expected one JSON object per line"),
    "glue tsv columns": ("glue/sst2", "in.tsv", "sentence\tlabel\na film\t1\nno label\n",
                         ":3: expected 2 tab-separated columns, found 1"),
    "glue tsv label": ("glue/sst2", "in.tsv", "sentence\tlabel\na film\tyes\n", ":2: label 'yes' is not one of"),
    "conll tokens null": ("conll2003", "in.jsonl", _lines({"tokens": ["EU", "rejects"]}, {"tokens": None}),
                          ":2: field 'tokens' is null; expected an object with \"tokens\": a list of words"),
    "conll token number": ("conll2003", "in.jsonl", _lines({"tokens": ["EU", 5]}),
                           ":1: tokens[1] is the number 5, expected a word (a string without spaces)"),
    "conll token blank": ("conll2003", "in.jsonl", _lines({"tokens": ["EU", " "]}),
                          ":1: tokens[1] is the string ' ', expected a word"),
    "conll no tokens": ("conll2003", "in.jsonl", _lines({"words": ["EU"]}), ":1: no field 'tokens'; expected"),
    "conll empty": ("conll2003", "eng.testb", "\n\n", ": file has no sentences (empty?)"),
    "swag columns": ("swag", "test.csv", f"{SWAG_HEADER}\n{SWAG_ROW}1\n0,v,7,s\n", ":3: expected 12 columns, found 4"),
    "swag label": ("swag", "test.csv", f"{SWAG_HEADER}\n{SWAG_ROW}4\n", ":2: label '4' is not one of 0..3"),
    "swag header": ("swag", "test.csv", "a,b\n1,2\n", ":1: header lacks columns"),
}


@pytest.mark.parametrize("case", list(PREDICT_CASES))
def test_predict_names_the_file_and_place_of_bad_input(tmp_path, capsys, no_model, case):
  task_name, name, contents, message = PREDICT_CASES[case]
  source = tmp_path / name
  source.write_text(contents if isinstance(contents, str) else json.dumps(contents, indent=1))
  no_model(task_name)
  code, err = _predict(capsys, source, tmp_path / "out.jsonl")
  assert code == 1
  assert err.count("\n") == 1, err
  assert err.startswith(f"bert-jax predict: error: {source}{message}"), err
  assert not (tmp_path / "out.jsonl").exists()


def test_training_files_name_the_file_and_place(tmp_path):
  """The readers `finetune` loads splits with: labels required, every column read."""
  (tmp_path / "dev-v1.1.json").write_text(json.dumps(_squad(answers=None)))
  with pytest.raises(ValueError, match=r"dev-v1\.1\.json: data\[1\]\.paragraphs\[0\]\.qas\[0\]\.answers is null, "
                                       r"expected a list"):
    get_task("squad/v1.1").load(tmp_path, "dev")
  (tmp_path / "dev-v1.1.json").write_text(json.dumps(_squad(answers=[])))
  with pytest.raises(ValueError, match=r"question q1 has no answers and is not marked impossible "
                                       r"\(data\[1\]\.paragraphs\[0\]\.qas\[0\]\)"):
    get_task("squad/v1.1").load(tmp_path, "dev")
  (tmp_path / "eng.testa").write_text("-DOCSTART- -X- O O\n\nEU NNP I-NP\n")
  with pytest.raises(ValueError, match=r"eng\.testa:3: expected 4 space-separated columns, found 3"):
    get_task("conll2003").load(tmp_path, "dev")
  (tmp_path / "val.csv").write_text(f"{SWAG_HEADER}\n{SWAG_ROW}\n")
  with pytest.raises(ValueError, match=r"val\.csv:2: label '' is not one of 0\.\.3"):
    get_task("swag").load(tmp_path, "dev")
  (tmp_path / "RTE").mkdir()
  (tmp_path / "RTE" / "dev.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tmaybe\n")
  with pytest.raises(ValueError, match=r"RTE[/\\]dev\.tsv:2: label 'maybe' is not one of"):
    get_task("glue/rte").load(tmp_path, "dev")


def test_unlabelled_squad_questions_still_read_for_predict(tmp_path):
  """Predict files may leave answers out or null; the fields that are there are still typed."""
  source = tmp_path / "questions.json"
  source.write_text(json.dumps(_squad(answers=None)))
  examples = get_task("squad/v1.1").read_file(source)
  assert [(e.qid, e.question, e.context, e.answers) for e in examples] == [("q1", "what?", "ctx here", ())]
