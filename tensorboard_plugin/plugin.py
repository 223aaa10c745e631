"""Entry point of the mpprof TensorBoard plugin: a loader that degrades gracefully.

TensorBoard imports this module for every user who has mpprof installed, so
it imports nothing heavy. `load()` imports the plugin and its dependencies
(mpprof, plotly for the charts); if one is missing the tab is
hidden and the reason logged, and TensorBoard starts as usual.
"""

from __future__ import annotations

import logging

from tensorboard.plugins import base_plugin

logger = logging.getLogger(__name__)


class MpprofPluginLoader(base_plugin.TBLoader):
    """Loads `routes.MpprofPlugin`, or returns None (no tab) saying why."""

    def load(self, context: base_plugin.TBContext) -> base_plugin.TBPlugin | None:
        try:
            from tensorboard_plugin_mpprof import routes

            routes.plotly_js_path()
        except (ImportError, FileNotFoundError) as e:
            logger.warning("mpprof TensorBoard tab disabled: %s", e)
            return None
        return routes.MpprofPlugin(context)
