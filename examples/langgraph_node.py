"""An RLM as one node of a LangGraph graph (a smaller sibling of ``dbos_workflow.py``).

The graph reads a document, asks an RLM a question about it, and checks the answer's shape. The
RLM node passes a run id derived from the graph's thread id, so a node retried by LangGraph (or
a re-invoked thread) gets the recorded run back or resumes it, instead of paying again; its
answer is checked data (``answer_schema``), not text to be parsed.

    pip install langgraph            # not a dependency of rlm-kernels
    export OPENAI_BASE_URL=... OPENAI_API_KEY=... RLM_MODEL=...   # or the embedded model
    python examples/langgraph_node.py essay.txt "Who is mentioned most, and how often?"

Not run by the test suite (LangGraph is not a test dependency); the DBOS example is the tested
one.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TypedDict

from langgraph.graph import END, START, StateGraph

import rlm

ANSWER = {"type": "object", "required": ["name", "count"], "additionalProperties": False,
          "properties": {"name": {"type": "string"}, "count": {"type": "integer", "minimum": 0}}}


class State(TypedDict, total=False):
    path: str
    question: str
    thread: str
    document: str
    answer: dict


def read(state: State) -> State:
    return {"document": Path(state["path"]).read_text(encoding="utf-8")}


async def ask(state: State) -> State:
    res = await rlm.acompletion(state["document"], state["question"],
                                run_id=f"{state['thread']}-ask", answer_schema=ANSWER)
    if res.status != "completed":
        raise RuntimeError(f"RLM run {res.run_id} ended {res.status}: {res.reason}")
    return {"answer": rlm.core.schema.load_answer(res.answer)}


def build():
    g = StateGraph(State)
    g.add_node("read", read)
    g.add_node("ask", ask)
    g.add_edge(START, "read")
    g.add_edge("read", "ask")
    g.add_edge("ask", END)
    return g.compile()


async def main(path: str, question: str, thread: str = "thread-1") -> dict:
    out = await build().ainvoke({"path": path, "question": question, "thread": thread})
    return out["answer"]


if __name__ == "__main__":
    import asyncio
    print(asyncio.run(main(sys.argv[1], sys.argv[2])))
