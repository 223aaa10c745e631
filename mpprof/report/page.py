"""The report file: styles, plotly.js and the plot data embedded in one page.

plotly.js is embedded from the installed `plotly` package, so the file opens
without a network. The embedded JSON has `</` escaped so it cannot close
its <script> element.
"""

from __future__ import annotations

import datetime
import json
import pathlib

from mpprof._version import __version__
from mpprof.report.sections import escape


def render_page(logdir: str, summary: str, sections: list[str], data: list[dict]) -> str:
    """The whole HTML file.

    Args:
        logdir: the logdir, as the user named it (shown in the header).
        summary: `sections.summary_html`.
        sections: each run's `sections.run_section`, in order.
        data: each run's `plots.run_data`, in the same order (report.js draws
            the plots from it).
    """
    generated = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    payload = script_json(data)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>mpprof report: {escape(logdir)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{_static("report.css")}</style>
<script>{_plotly_js()}</script>
</head><body>
<header><h1>mpprof report</h1>
<p>Logdir <code>{escape(logdir)}</code>, {len(sections)} run(s), generated {escape(generated)}
by mpprof {escape(__version__)}.</p></header>
{summary}
{"".join(sections)}
<script type="application/json" id="mpprof-data">{payload}</script>
<script>{_static("report.js")}</script>
</body></html>
"""


def script_json(value) -> str:
    """JSON safe inside <script>: no `</` can end the element early."""
    text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    return text.replace("</", "<\\/").replace("<!--", "<\\u0021--")


def _plotly_js() -> str:
    import plotly

    path = pathlib.Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    return path.read_text(encoding="utf-8").replace("</script", "<\\/script")


def _static(name: str) -> str:
    """A file shipped beside this module in static/."""
    return (pathlib.Path(__file__).parent / "static" / name).read_text(encoding="utf-8")
