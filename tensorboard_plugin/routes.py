"""The mpprof TensorBoard plugin: HTTP routes under /data/plugin/mpprof/.

JSON routes take `run` (a name from /runs) and answer 404 for an unknown run
or layer and 400 for a bad parameter (tensorboard.errors, which TensorBoard
turns into clean responses). Static files are served from a fixed listing of
the `static/` folder, never from a path built from the request.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
import pathlib
import threading
from collections.abc import Callable

from tensorboard import errors
from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from mpprof.display import run_digest
from mpprof.records import filesystem
from tensorboard_plugin_mpprof import metadata, payloads, run_sources
from tensorboard_plugin_mpprof.run_cache import CachedRun, RunCache

_STATIC_TYPES = {".js": "text/javascript", ".css": "text/css"}
# Static files change only with the package; a short browser cache is safe.
_STATIC_EXPIRES_S = 60
_PLOTLY_EXPIRES_S = 24 * 3600


def plotly_js_path() -> importlib.resources.abc.Traversable:
    """plotly.min.js as shipped inside the installed plotly package."""
    path = importlib.resources.files("plotly") / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed plotly package")
    return path


class MpprofPlugin(base_plugin.TBPlugin):
    """The "mpprof" tab: findings, precision inventory, loss scale, numerics,
    histograms, GPU, float8."""

    plugin_name = metadata.PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext):
        # TensorBoard's logdir, or its multiplexer's runs (`--logdir_spec`).
        self._runs = RunCache(run_sources.run_source(context.logdir, context.multiplexer))
        self._static_dir = pathlib.Path(__file__).resolve().parent / "static"
        self._static_names = frozenset(
            entry.name
            for entry in self._static_dir.iterdir()
            if entry.is_file() and entry.suffix in _STATIC_TYPES
        )
        self._plotly_gzip: bytes | None = None
        self._plotly_lock = threading.Lock()

    def get_plugin_apps(self) -> dict:
        return {
            metadata.ES_MODULE_ROUTE: self._index_js,
            metadata.STATIC_ROUTE_PREFIX + "*": self._static,
            metadata.PLOTLY_ROUTE: self._plotly,
            "/runs": self._list_runs,
            "/context": self._run_route(lambda args: ("context", payloads.context_payload)),
            "/findings": self._run_route(
                lambda args: ("findings", payloads.findings_payload), diagnosed=True
            ),
            "/inventory": self._run_route(lambda args: ("inventory", payloads.inventory_payload)),
            "/loss_scale": self._run_route(self._loss_scale),
            "/numerics": self._run_route(self._numerics),
            "/layer_history": self._run_route(self._layer_history),
            "/histogram": self._run_route(self._histogram),
            "/gpu": self._run_route(self._gpu),
            "/float8": self._run_route(self._float8),
            "/advice": self._run_route(lambda args: ("advice", payloads.advice_payload)),
        }

    def is_active(self) -> bool:
        """Asked only when TensorBoard's data provider does not list "mpprof".

        A local logdir with mpprof summaries is always listed there. A remote
        one may not be: TensorBoard reads s3:// only through TensorFlow's file
        systems (gone from TensorFlow since 2.6) or boto3, RustBoard only
        local disks and GCS. The plugin reads it itself (fsspec), so the tab
        shows when its own listing finds runs."""
        if not filesystem.is_remote(self._runs.logdir):
            return False
        return bool(self._runs.list_runs())

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(
            es_module_path=metadata.ES_MODULE_ROUTE, tab_name=metadata.TAB_NAME
        )

    # JSON routes ------------------------------------------------------------

    @wrappers.Request.application
    def _list_runs(self, request):
        # Each run's summary (and its JSON text) is kept while its files are
        # unchanged: a sweep of many runs is read once, then only what changed;
        # a run whose fit wrote its digest is not read at all (`run_digest`:
        # the same row, computed by the fit).
        def summarize(cached: CachedRun) -> dict:
            return run_digest.run_summary(cached.run, _diagnosis(cached))

        return http_util.Respond(
            request, self._runs.summaries_json(summarize, digests=run_digest.load_many),
            "application/json")

    # Each run route parses its parameters (400 on a bad one) and returns a
    # cache key and the payload's computation; see `_run_route`.

    @staticmethod
    def _loss_scale(args):
        points = _int_arg(args, "points", metadata.DEFAULT_POINTS, 2, metadata.MAX_POINTS)
        return ("loss_scale", points), lambda r: payloads.loss_scale_payload(r, points)

    @staticmethod
    def _numerics(args):
        direction = _choice_arg(args, "direction", payloads.NUMERICS_DIRECTIONS)
        stat = _choice_arg(args, "stat", payloads.NUMERICS_STATS + (payloads.HEADROOM,))
        if stat == payloads.HEADROOM and direction != "forward":
            raise errors.InvalidArgumentError("stat=headroom needs direction=forward")
        rows = _int_arg(args, "rows", metadata.DEFAULT_HEATMAP_ROWS, 1, metadata.MAX_POINTS)
        columns = _int_arg(
            args, "columns", metadata.DEFAULT_HEATMAP_COLUMNS, 1, metadata.MAX_POINTS
        )
        return (
            ("numerics", direction, stat, rows, columns),
            lambda r: payloads.numerics_payload(r, direction, stat, rows, columns),
        )

    @staticmethod
    def _layer_history(args):
        layer = args.get("layer")
        if not layer:
            raise errors.InvalidArgumentError("Missing query parameter: layer")
        points = _int_arg(args, "points", metadata.DEFAULT_POINTS, 2, metadata.MAX_POINTS)
        return (
            ("layer_history", layer, points),
            lambda r: payloads.layer_history_payload(r, layer, points),
        )

    @staticmethod
    def _histogram(args):
        layer = args.get("layer")
        if not layer:
            raise errors.InvalidArgumentError("Missing query parameter: layer")
        direction = _choice_arg(args, "direction", payloads.NUMERICS_DIRECTIONS)
        columns = _int_arg(
            args, "columns", metadata.DEFAULT_HEATMAP_COLUMNS, 1, metadata.MAX_POINTS
        )
        return (
            ("histogram", layer, direction, columns),
            lambda r: payloads.histogram_payload(r, layer, direction, columns),
        )

    @staticmethod
    def _gpu(args):
        points = _int_arg(args, "points", metadata.DEFAULT_POINTS, 2, metadata.MAX_POINTS)
        return ("gpu", points), lambda r: payloads.gpu_payload(r, points)

    @staticmethod
    def _float8(args):
        layer = args.get("layer") or None
        rows = _int_arg(args, "rows", metadata.DEFAULT_HEATMAP_ROWS, 1, metadata.MAX_POINTS)
        columns = _int_arg(
            args, "columns", metadata.DEFAULT_HEATMAP_COLUMNS, 1, metadata.MAX_POINTS
        )
        points = _int_arg(args, "points", metadata.DEFAULT_POINTS, 2, metadata.MAX_POINTS)
        return (
            ("float8", layer, rows, columns, points),
            lambda r: payloads.float8_payload(r, layer, rows, columns, points),
        )

    def _run_route(self, handler: Callable, diagnosed: bool = False) -> Callable:
        """A JSON route about the run named by the `run` query parameter.

        The response body is cached, gzipped, with the run's read: a reload
        that finds no new data costs a stat of the run's event files.

        Args:
            handler: parses the request's arguments; returns a cache key and
                the payload's computation, called with the `reader.Run` (and
                with its diagnosis too when `diagnosed`).
            diagnosed: whether the computation needs the run's diagnosis.
        """

        @wrappers.Request.application
        def route(request):
            key, compute = handler(request.args)
            run = self._runs.get(_run_name(request.args))
            if diagnosed:
                # Derived on its own first: `derive` does not nest.
                result = _diagnosis(run)
                body = run.derive(key, lambda r: _gzip_json(compute(r, result)))
            else:
                body = run.derive(key, lambda r: _gzip_json(compute(r)))
            return http_util.Respond(request, body, "application/json", content_encoding="gzip")

        return route

    # Static files -----------------------------------------------------------

    @wrappers.Request.application
    def _index_js(self, request):
        return self._static_file(request, metadata.ES_MODULE_ROUTE.lstrip("/"))

    @wrappers.Request.application
    def _static(self, request):
        prefix = f"/{metadata.PLUGIN_NAME}{metadata.STATIC_ROUTE_PREFIX}"
        name = request.path.partition(prefix)[2]
        return self._static_file(request, name)

    def _static_file(self, request, name: str):
        # Only names listed from the static folder are served: "../x",
        # "%2e%2e/x" or "a/b" are not in the listing and are never opened.
        if name not in self._static_names:
            raise errors.NotFoundError(f"No static file {name!r}")
        content_type = _STATIC_TYPES[name[name.rfind(".") :]]
        body = (self._static_dir / name).read_bytes()
        return http_util.Respond(request, body, content_type, expires=_STATIC_EXPIRES_S)

    @wrappers.Request.application
    def _plotly(self, request):
        with self._plotly_lock:
            if self._plotly_gzip is None:
                # Compressed once: 4.8 MB of JavaScript, 1.6 MB gzipped.
                self._plotly_gzip = gzip.compress(plotly_js_path().read_bytes(), mtime=0)
        return http_util.Respond(
            request,
            self._plotly_gzip,
            _STATIC_TYPES[".js"],
            content_encoding="gzip",
            expires=_PLOTLY_EXPIRES_S,
        )


def _diagnosis(cached: CachedRun):
    """The run's diagnosis, computed once per read (the run list and findings)."""
    return cached.derive("diagnosis", payloads.evaluate)


def _gzip_json(payload: dict) -> bytes:
    # Level 3, as TensorBoard's own responses: most of the gain, little CPU.
    return gzip.compress(json.dumps(payload, allow_nan=False).encode(), 3, mtime=0)


def _int_arg(args, name: str, default: int, low: int, high: int) -> int:
    raw = args.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise errors.InvalidArgumentError(f"{name} must be an integer, got {raw!r}") from None
    if not low <= value <= high:
        raise errors.InvalidArgumentError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def _choice_arg(args, name: str, choices: tuple[str, ...]) -> str:
    value = args.get(name)
    if value not in choices:
        raise errors.InvalidArgumentError(
            f"{name} must be one of {', '.join(choices)}; got {value!r}"
        )
    return value


def _run_name(args) -> str | None:
    """The run a request names: `run`, or `run_json` (its JSON text), which
    the tab sends for a name that is not valid Unicode (a directory name that
    is not UTF-8, listed with Python's surrogate escapes): a URL would turn
    those into U+FFFD, JSON keeps them exactly (static/api.js)."""
    encoded = args.get("run_json")
    if encoded is None:
        return args.get("run")
    try:
        name = json.loads(encoded)
    except ValueError as e:
        raise errors.InvalidArgumentError(f"run_json is not JSON text: {e}") from e
    if not isinstance(name, str):
        raise errors.InvalidArgumentError("run_json is not a JSON string")
    return name
