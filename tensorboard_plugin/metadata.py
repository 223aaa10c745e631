"""Names the plugin owns: its plugin name, routes, static files and limits.

Light on purpose: the loader imports it before it knows whether the plugin's
dependencies are installed.
"""

from __future__ import annotations

# Same string as `mpprof.records.schema.PLUGIN_NAME` (a test checks they agree); kept
# here so the loader can name the plugin without importing TensorFlow.
PLUGIN_NAME = "mpprof"
TAB_NAME = "mpprof"

# The ES module TensorBoard imports; it imports the other static modules.
ES_MODULE_ROUTE = "/index.js"
STATIC_ROUTE_PREFIX = "/static/"
PLOTLY_ROUTE = "/plotly.min.js"

# Screen-sized payloads: a chart is at most a few thousand pixels wide, so a
# series or a heatmap column count beyond this only costs bandwidth.
DEFAULT_POINTS = 1500
MAX_POINTS = 5000
DEFAULT_HEATMAP_COLUMNS = 600
DEFAULT_HEATMAP_ROWS = 400
# Overflow markers beyond this are thinned (the total is still reported).
MAX_MARKERS = 3000
