"""An RLM as one step of a durable DBOS workflow, on SQLite, that survives a crash.

The workflow reads a document (a step), asks an RLM about it (a step), and formats a report (a
step). DBOS checkpoints each step's output in its SQLite database; after a crash, launching the
app again recovers the unfinished workflow and re-runs it, skipping the steps that finished.

The RLM step passes a run id derived from the workflow id and the step's id. When DBOS re-runs
the step after a crash, ``rlm.completion`` finds that run in the RLM journal: a finished run
returns its recorded answer; a crashed one resumes, every model call the journal holds served
from it (not sent, not paid again). So a retried step never pays twice.

    pip install 'rlm-kernels[examples]'
    export OPENAI_BASE_URL=... OPENAI_API_KEY=... RLM_MODEL=...   # or the embedded model
    python examples/dbos_workflow.py start --workflow-id report-1 --doc essay.txt \\
        --question "What is the magic number?"
    # ... the process dies mid-run (kill -9) ...
    python examples/dbos_workflow.py recover --workflow-id report-1   # finishes it

Files: ``--data DIR`` holds the DBOS database (``dbos.sqlite``) and the RLM journal
(``rlm-journal.sqlite3``) unless ``RLM_JOURNAL`` names another.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dbos import DBOS, DBOSConfig, SetWorkflowID

import rlm


@DBOS.step()
def read_document(path: str) -> str:
    """Step 1: the document's text (checkpointed: not read again after a crash)."""
    return Path(path).read_text(encoding="utf-8")


@DBOS.step()
def ask_rlm(document: str, question: str) -> str:
    """Step 2: one RLM run; its run id is the workflow id plus this step's id."""
    run_id = f"{DBOS.workflow_id}-step{DBOS.step_id}"
    res = rlm.completion(document, question, run_id=run_id,
                         on_progress=lambda m: print(f"[{run_id}] {m}", flush=True))
    if res.status != "completed":
        # DBOS records the failure; a retry of the workflow resumes the same run id
        raise RuntimeError(f"RLM run {run_id} ended {res.status}: {res.reason}")
    return res.answer


@DBOS.step()
def write_report(question: str, answer: str) -> str:
    """Step 3: the report the workflow returns."""
    return json.dumps({"question": question, "answer": answer})


@DBOS.workflow()
def report_workflow(doc_path: str, question: str) -> str:
    """Read the document, ask the RLM, write the report."""
    doc = read_document(doc_path)
    answer = ask_rlm(doc, question)
    return write_report(question, answer)


def launch(data: Path) -> None:
    """Configure DBOS on SQLite under ``data`` and launch it (this recovers pending workflows)."""
    data.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RLM_JOURNAL", str(data / "rlm-journal.sqlite3"))
    config: DBOSConfig = {"name": "rlm-dbos-example",
                          "system_database_url": f"sqlite:///{data / 'dbos.sqlite'}"}
    DBOS(config=config)
    DBOS.launch()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("start", "recover"))
    p.add_argument("--workflow-id", required=True)
    p.add_argument("--doc", help="the document (start)")
    p.add_argument("--question", help="the question (start)")
    p.add_argument("--data", default="dbos-data", help="directory of the databases")
    args = p.parse_args(argv)
    launch(Path(args.data))
    if args.mode == "start":
        with SetWorkflowID(args.workflow_id):
            handle = DBOS.start_workflow(report_workflow, str(Path(args.doc).resolve()),
                                         args.question)
    else:  # launch() has already started recovering it; wait for its result
        handle = DBOS.retrieve_workflow(args.workflow_id)
    print(handle.get_result(), flush=True)
    DBOS.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
