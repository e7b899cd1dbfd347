"""Reports: load a results folder into pandas, draw the figures, write Markdown + self-contained HTML.

    from kveval.report import load, plots, report_command
    res = load("results/int4_g64")        # RunResults: summary, positions, layers, needle, sensitivity, memory...
    plots.quality_vs_memory(res)          # a matplotlib Figure
    report_command(["results/int4_g64"])  # report.md, report.html, tables/*.csv, plots/*.png in the run folder
"""

from kveval.report.load import RunResults, load, read_metrics
from kveval.report.render import report_command, write_run_report

__all__ = ["RunResults", "load", "read_metrics", "report_command", "write_run_report"]
