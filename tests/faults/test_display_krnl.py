"""Issue 26, kind 2: what a cell displays is what the model sees.

The model gets the richest text form of each output (``text/markdown``, a meaningful
``text/plain``, HTML reduced to its text, LaTeX, JSON), a DataFrame's table, a traceback, and a
short note for images and other binary outputs; ``clear_output``, updated displays and carriage
returns behave as in a notebook; everything is cut to the output limit as text is.

Real kernels, the scripted server on 127.0.0.1 and the real ``openai`` client: each test reads
the feedback the model really got after its cell.
"""
from __future__ import annotations

import pytest

from conftest import last_user, repl, root_requests, script

from kernels.outputs import bundle_text, html_text, render_stream


def seen(api, *lines, **options) -> str:
    """What the model was told after one cell of ``lines``."""
    res, srv = api(script([repl(*lines), repl("FINAL('done')")]), "ctx", **options)
    assert res.status == "completed", res.reason
    return last_user(root_requests(srv)[1])


def test_example_markdown_and_html_reach_the_model_as_text(api):
    told = seen(api, "from IPython.display import display, Markdown, HTML",
                "display(Markdown('## Findings\\n*alpha* is **42**'))",
                "display(HTML('<p>Total: <b>17</b></p><ul><li>one</li><li>two</li></ul>'"
                "             '<script>alert(1)</script><style>p {color: red}</style>'))")
    assert "object>" not in told, told
    assert "## Findings\n*alpha* is **42**" in told
    assert "Total: 17" in told and "- one" in told and "- two" in told
    assert "alert" not in told and "color" not in told


def test_a_dataframe_shows_its_table_displayed_or_as_the_result(api):
    pytest.importorskip("pandas")
    told = seen(api, "import pandas as pd",
                "df = pd.DataFrame({'city': ['Lisbon', 'Oslo'], 'n': [3, 5]})",
                "display(df)",
                "df.describe().loc[['mean']]")
    assert "Lisbon" in told and "Oslo" in told and "city" in told
    assert "mean" in told and "4.0" in told
    assert "<table" not in told and "<td>" not in told


def test_images_become_a_short_note(api):
    told = seen(api, "import matplotlib.pyplot as plt",
                "plt.plot([1, 2, 3]); plt.show()",
                "from IPython.display import display, Image",
                "import base64",
                "png = base64.b64decode('iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42m"
                "Nk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==')",
                "display(Image(data=png))",
                "print('after')")
    assert "[image/png image 1x1 displayed" in told
    assert told.count("[image/png image") == 2, told
    assert "iVBOR" not in told  # never the encoded image
    assert "after" in told


def test_latex_json_and_objects_without_a_text_form(api):
    told = seen(api, "from IPython.display import display, Latex, JSON, Javascript",
                "display(Latex(r'$\\frac{a}{b}$'))",
                "display(JSON({'k': [1, 2]}))",
                "display(Javascript('console.log(1)'))",
                "class Plain: pass",
                "Plain()")
    assert "$\\frac{a}{b}$" in told
    assert '{"k": [1, 2]}' in told
    assert "[application/javascript output displayed" in told
    assert "<__main__.Plain" in told  # nothing richer: what the notebook shows


def test_updated_displays_cleared_output_and_progress_lines(api):
    told = seen(api, "from IPython.display import display, clear_output, Markdown",
                "h = display(Markdown('step one'), display_id=True)",
                "h.update(Markdown('step two'))",
                "print('noise before the clear')",
                "clear_output()",
                "for i in range(5):",
                "    print(f'\\rprogress {i * 25}%', end='')",
                "print()",
                "print('\\x1b[31mred\\x1b[0m text')")
    assert "noise before the clear" not in told and "step one" not in told
    assert "progress 100%" in told and "progress 25%" not in told
    assert "red text" in told and "\x1b" not in told


def test_clear_output_wait_clears_at_the_next_output(api):
    told = seen(api, "from IPython.display import clear_output",
                "print('first')", "clear_output(wait=True)", "print('second')")
    assert "second" in told and "first" not in told


def test_tracebacks_reach_the_model_and_displays_are_cut_to_the_output_limit(api):
    told = seen(api, "from IPython.display import display, Markdown",
                "display(Markdown('M' * 20000))",
                "1 / 0", max_output_chars=1500)
    assert "characters cut" in told
    assert len(told) < 2500
    assert "ZeroDivisionError" in told


def test_bundle_text_prefers_the_richest_text():
    assert bundle_text({"text/plain": "<IPython.core.display.Markdown object>",
                        "text/markdown": "# t"}) == "# t\n"
    assert bundle_text({"text/plain": "  a  b\n0 1 2", "text/html": "<table>...</table>"}) \
        == "  a  b\n0 1 2\n"
    html = bundle_text({"text/plain": "<IPython.core.display.HTML object>",
                        "text/html": "<table><tr><th>a</th><th>b</th></tr>"
                                     "<tr><td>1</td><td>2&amp;3</td></tr></table>"})
    assert html == "a | b\n1 | 2&3\n"
    note = bundle_text({"text/plain": "<Figure size 640x480 with 1 Axes>",
                        "image/png": "iVBORw0KGgoAAAANSUhEUgAAAoAAAAHg" + "A" * 100})
    assert note.startswith("<Figure size 640x480 with 1 Axes>\n[image/png image 640x480")
    assert bundle_text({}) == ""
    widget = bundle_text({"text/plain": "IntSlider(value=0)",
                          "application/vnd.jupyter.widget-view+json": {"model_id": "x"}})
    assert "IntSlider(value=0)" in widget and "interactive widget" in widget


def test_html_and_stream_rendering_are_linear_and_exact():
    assert html_text("<div>a<br>b</div><pre>c</pre>") == "a\nb\nc"
    assert render_stream("a\rb\r\nc\r\nd") == "b\nc\nd"
    assert render_stream("x\x1b[1;32my\x1b[0m") == "xy"
    big = "\r".join(str(i) for i in range(200000))
    assert render_stream(big) == "199999"
