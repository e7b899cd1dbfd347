"""A report as a list of blocks (heading, paragraph, list, table, image, code), rendered twice: Markdown
(images as relative ``plots/*.png`` links) and HTML (images embedded as base64 ``data:`` URIs, the stylesheet
inline, no scripts and no external links: one file that reads offline). The report (:mod:`kveval.report.render`)
and the tasks' reporting plug-ins (:mod:`kveval.report.sections`) build blocks; everything rendered as Markdown or
HTML goes through :func:`to_markdown` and :func:`to_html` (a lone table too: ``to_markdown([Block("table", df)])``).
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

import pandas as pd

from kveval.report.blocks import Block
from kveval.report.tables import cell_text


def _line(text: object) -> str:
    """``text`` on one line (line breaks as spaces): a run or policy name with a newline cannot start a heading,
    a list item or a table row of its own in report.md."""
    return " ".join(str(text).splitlines())


def _fence(code: str) -> str:
    """A code fence longer than any run of backticks in ``code`` (a path holding ````` cannot close it)."""
    longest = max((len(m) for m in re.findall(r"`+", code)), default=0)
    return "`" * max(3, longest + 1)


def to_markdown(blocks: list[Block]) -> str:
    """report.md from the blocks; names and other text from the run files are kept to their cell, line or item
    (tables: :func:`md_cell`; headings, paragraphs, list items, captions: one line)."""
    out = []
    for b in blocks:
        if b.kind == "h":
            out.append("#" * b.level + " " + _line(b.content))
        elif b.kind == "p":
            out.append(_line(b.content))
        elif b.kind == "ul":
            out.append("\n".join(f"- {_line(item)}" for item in b.content))
        elif b.kind == "table":
            out.append((f"*{_line(b.caption)}*\n\n" if b.caption else "") + _markdown_table(b.content))
        elif b.kind == "img":
            src, alt = b.content
            out.append(f"![{_line(alt)}]({src})" + (f"\n\n*{_line(b.caption)}*" if b.caption else ""))
        elif b.kind == "code":
            fence = _fence(str(b.content))
            out.append(f"{fence}bash\n" + str(b.content) + f"\n{fence}")
    return "\n\n".join(out) + "\n"


STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; max-width: 1150px;
       margin: 2em auto; padding: 0 1em; color: #222; line-height: 1.45; }
h1 { border-bottom: 2px solid #0072B2; padding-bottom: .2em; }
h2 { border-bottom: 1px solid #ccc; padding-bottom: .15em; margin-top: 1.8em; }
table { border-collapse: collapse; margin: .6em 0 1.2em; font-size: 0.9em; }
caption { caption-side: top; text-align: left; font-style: italic; padding-bottom: .3em; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.pass { background: #d9f2e6; font-weight: 600; }
td.fail { background: #fbe0d2; font-weight: 600; }
td.within_noise { background: #dcecf7; font-weight: 600; }
td.inconclusive { background: #fdf3c8; font-weight: 600; }
figure { margin: 1em 0 1.6em; }
figure img { max-width: 100%; height: auto; border: 1px solid #ddd; }
figcaption { font-size: .9em; color: #444; }
pre { background: #f6f6f6; padding: .7em; overflow-x: auto; }
@media print { body { max-width: none; } figure { break-inside: avoid; } }
"""


def to_html(blocks: list[Block], title: str, out: Path) -> str:
    """One self-contained HTML file: inline stylesheet, PNGs as base64 data URIs, no scripts, no links."""
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{html.escape(title)}</title>", f"<style>{STYLE}</style></head><body>"]
    for b in blocks:
        if b.kind == "h":
            parts.append(f"<h{b.level}>{html.escape(str(b.content))}</h{b.level}>")
        elif b.kind == "p":
            parts.append(f"<p>{html.escape(str(b.content))}</p>")
        elif b.kind == "ul":
            parts.append("<ul>" + "".join(f"<li>{html.escape(str(i))}</li>" for i in b.content) + "</ul>")
        elif b.kind == "table":
            parts.append(_html_table(b.content, b.caption or None))
        elif b.kind == "img":
            src, alt = b.content
            data = base64.b64encode((out / src).read_bytes()).decode("ascii")
            parts.append(f'<figure><img alt="{html.escape(alt)}" '
                         f'src="data:image/png;base64,{data}"><figcaption>{html.escape(b.caption)}</figcaption>'
                         "</figure>")
        elif b.kind == "code":
            parts.append(f"<pre><code>{html.escape(str(b.content))}</code></pre>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------------- tables


def _markdown_table(df: pd.DataFrame) -> str:
    """A GitHub Markdown table (no tabulate dependency); numbers right-aligned."""
    if df.empty:
        return "_(empty)_"
    cols = list(df.columns)
    cells = [[cell_text(v) for v in row] for row in df.itertuples(index=False)]
    numeric = [all(_looks_numeric(c[i]) for c in cells if c[i]) for i in range(len(cols))]
    head = "| " + " | ".join(md_cell(str(c)) for c in cols) + " |"
    sep = "|" + "|".join("---:" if n else ":---" for n in numeric) + "|"
    body = ["| " + " | ".join(md_cell(c) for c in row) + " |" for row in cells]
    return "\n".join([head, sep, *body])


def md_cell(text: str) -> str:
    """``text`` as one Markdown table cell: ``|`` escaped, line breaks (``\\r``, ``\\n``, the Unicode ones) as
    ``<br>``, so that a policy or run name can neither end its cell nor start a new row; backslashes before a
    ``|`` are doubled so that they cannot cancel its escape (and still show as typed)."""
    text = re.sub(r"(\\*)\|", lambda m: m.group(1) * 2 + "\\|", text)
    return "<br>".join(text.splitlines()) if any(c in text for c in "\r\n\v\f\x1c\x1d\x1e\x85\u2028\u2029") else text


def _html_table(df: pd.DataFrame, caption: str | None = None) -> str:
    """A plain HTML table (escaped, no links), verdict cells classed ``pass`` / ``fail`` for the stylesheet."""
    parts = ["<table>"]
    if caption:
        parts.append(f"<caption>{html.escape(caption)}</caption>")
    parts.append("<thead><tr>" + "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns) + "</tr></thead>")
    parts.append("<tbody>")
    for row in df.itertuples(index=False):
        tds = []
        for col, v in zip(df.columns, row):
            text = cell_text(v)
            word = text.split(" ")[0]
            cls = f' class="{word}"' if col == "verdict" and word in ("pass", "fail", "within_noise", "inconclusive") else (
                ' class="num"' if _looks_numeric(text) else "")
            tds.append(f"<td{cls}>{html.escape(text)}</td>")
        parts.append("<tr>" + "".join(tds) + "</tr>")
    parts.append("</tbody></table>")
    return "\n".join(parts)


def _looks_numeric(text: str) -> bool:
    """A cell that is a number, with its unit, its ± uncertainty or its (MDE) / [CI] after it: right-aligned like
    every other number of its column."""
    t = text.replace(",", "").replace("×", "").replace("%", "").strip()
    t = re.split(r" ± | \(| \[", t, maxsplit=1)[0]
    try:
        float(t)
        return True
    except ValueError:
        return False


__all__ = ["Block", "md_cell", "to_html", "to_markdown"]
