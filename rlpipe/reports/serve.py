"""`rlpipe view`: a local page over one iteration's Parquet files, for what a static page cannot hold.

The page (rlpipe/reports/assets: one HTML file, a script and a stylesheet, shipped in the wheel; nothing
from a CDN) asks this server for one page of rows at a time (rlpipe.reports.browse), a sample's token view
when it is opened (drawn by rlpipe.reports.html, as `rlpipe inspect --html` draws it) and one prompt's
samples in every tagged iteration. Starlette answers, uvicorn serves, on 127.0.0.1 unless told otherwise:
the rows may be private. A mistake in a query (a --where naming no column) is a 400 whose body names it.
"""
from __future__ import annotations

import socket
import tempfile
import threading
import traceback
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlpipe.data.decode import TokenDecoder, find_decoder
from rlpipe.data.io import count_rows
from rlpipe.errors import ArtifactError, RlpipeError
from rlpipe.reports import browse, html
from rlpipe.reports.inspect import COLOR_COLUMNS, color_column, row_records

ASSETS = Path(__file__).parent / "assets"
ASSET_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8"}


class Viewer:
    """What the endpoints answer from: the iteration served, its tokenizer, and the other iterations opened
    so far (for one prompt across iterations), each opened once."""

    def __init__(self, it: browse.Iteration, *, decoder: TokenDecoder | None, workdir: Path) -> None:
        self.it, self.decoder, self.workdir = it, decoder, workdir
        self._others: dict[str, browse.Iteration | str] = {}
        self._lock = threading.Lock()

    def info(self) -> dict[str, Any]:
        it = self.it
        columns = browse.filter_columns(it)
        return {"label": it.label, "view": it.view, "revision": it.rev, "total": count_rows(it.files[it.base]),
                "table_columns": browse.table_columns(it), "columns": columns,
                "color_columns": [c for c in COLOR_COLUMNS if c in columns], "docs": browse.column_docs(it),
                "files": {role: str(f) for role, f in it.files.items()}, "warnings": browse.iteration_warnings(it),
                "tokenizer": str(self.decoder.path) if self.decoder else None,
                "preview_chars": browse.PREVIEW_CHARS}

    def rows(self, query: browse.Query) -> dict[str, Any]:
        return browse.page(self.it, query)

    def sample(self, prompt_id: int, sample_idx: int, color_by: str | None) -> dict[str, Any]:
        row = browse.sample_row(self.it, prompt_id, sample_idx)
        color = color_column(row, color_by)
        rec = row_records(row, decoder=self.decoder, color_by=color)[0]
        return {"prompt_id": prompt_id, "sample_idx": sample_idx, "prompt": rec.get("prompt"),
                "answer": browse.json_value(rec.get("answer")), "color_by": color,
                "html": html.sample_html(rec, color)}

    def iterations(self) -> tuple[list[tuple[str, browse.Iteration | str]], str]:
        """Every tagged iteration of the project (the one served is used as it is, not opened again), then
        the served one when it is no tag (a new workspace, a branch); and the name of the served one."""
        it = self.it
        if it.root is None:
            return [(it.label, it)], it.label
        served = it.rev if it.rev is not None else browse.workspace_tag(it.root)
        tags = browse.iteration_revisions(it.root)
        out = []
        for tag in tags:
            with self._lock:
                if tag not in self._others:
                    self._others[tag] = it if tag == served else self._open(tag)
                out.append((tag, self._others[tag]))
        if served not in tags:
            served = served or "workspace"
            out.append((served, it))
        return out, served

    def _open(self, tag: str) -> browse.Iteration | str:
        try:
            return browse.open_iteration(self.it.root, rev=tag, eval_view=self.it.view == "eval",
                                         workdir=self.workdir)
        except RlpipeError as e:
            return str(e)

    def prompt(self, prompt_id: int) -> dict[str, Any]:
        iterations, served = self.iterations()
        return {"prompt_id": prompt_id, "current": served,
                "iterations": browse.prompt_history(iterations, prompt_id)}


def _int(params: Any, name: str, default: int | None = None) -> int:
    raw = params.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(f"{name}: required")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: not an integer") from None


def _query(params: Any) -> browse.Query:
    return browse.Query(where=params.get("where") or None, sort=params.get("sort") or None,
                        descending=params.get("desc") in ("1", "true", "yes"), search=params.get("search") or None,
                        offset=_int(params, "offset", 0), limit=_int(params, "limit", 50))


def make_app(viewer: Viewer):
    """The Starlette application: the page and its assets, and four JSON endpoints."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def answer(work: Callable[[Any], Any]) -> Callable:
        def endpoint(request):  # plain functions: Starlette runs them in its thread pool, off the event loop
            try:
                return JSONResponse(work(request.query_params))
            except LookupError as e:
                return JSONResponse({"error": str(e.args[0] if e.args else e)}, status_code=404)
            except (RlpipeError, ValueError) as e:
                return JSONResponse({"error": str(e)}, status_code=400)
            except Exception as e:  # noqa: BLE001 - a bug, but the page shows what it was, not "Unexpected token"
                traceback.print_exc()
                return JSONResponse({"error": f"internal error: {type(e).__name__}: {e}"}, status_code=500)
        return endpoint

    def asset(request):
        name = request.path_params.get("name", "index.html")
        if name == "report.css":  # the inspect page's own styles, so a token view looks as it does there
            return Response(html.CSS, media_type=ASSET_TYPES[".css"])
        path = ASSETS / name
        if "/" in name or not path.is_file() or path.suffix not in ASSET_TYPES:
            return Response("not found", status_code=404, media_type="text/plain")
        return Response(path.read_bytes(), media_type=ASSET_TYPES[path.suffix])

    routes = [
        Route("/", asset),
        Route("/assets/{name}", asset),
        Route("/api/info", answer(lambda p: viewer.info())),
        Route("/api/rows", answer(lambda p: viewer.rows(_query(p)))),
        Route("/api/sample", answer(lambda p: viewer.sample(_int(p, "prompt_id"), _int(p, "sample_idx"),
                                                            p.get("color_by") or None))),
        Route("/api/prompt", answer(lambda p: viewer.prompt(_int(p, "prompt_id")))),
    ]
    return Starlette(routes=routes)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (0 = any free port), or an error that says what to change."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise ArtifactError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port "
                            "(0 = any free one) or --host") from None
    sock.listen(128)
    return sock


def open_viewer(target: str, *, rev: str | None, eval_view: bool, tokenizer: str | None,
                workdir: Path) -> Viewer:
    """The iteration and its tokenizer, checked before anything listens: a bad target fails at once."""
    it = browse.open_iteration(target, rev=rev, eval_view=eval_view, workdir=workdir)
    browse.table_columns(it)  # every file's schema readable
    return Viewer(it, decoder=find_decoder(it.model_dirs, tokenizer), workdir=workdir)


def serve(target: str, *, rev: str | None = None, eval_view: bool = False, host: str = "127.0.0.1",
          port: int = 8765, tokenizer: str | None = None, echo: Callable[[str], None] = print,
          on_ready: Callable[[str], None] | None = None, start: dict[str, str] | None = None) -> None:
    """Serve ``target`` until Ctrl-C (uvicorn stops on SIGINT/SIGTERM and returns; the temporary copies of
    other iterations' files are removed then). ``start``: the page's first query (``where``, ``sort``, ``desc``,
    ``color``), put in the address's fragment, where the page keeps its state."""
    import uvicorn

    with tempfile.TemporaryDirectory(prefix="rlpipe-view-") as tmp:
        viewer = open_viewer(target, rev=rev, eval_view=eval_view, tokenizer=tokenizer, workdir=Path(tmp))
        sock = bind(host, port)
        try:
            shown = f"[{host}]" if ":" in host else host
            fragment = urllib.parse.urlencode({k: v for k, v in (start or {}).items() if v},
                                              quote_via=urllib.parse.quote)
            url = f"http://{shown}:{sock.getsockname()[1]}/" + (f"#{fragment}" if fragment else "")
            echo(f"rlpipe view: {viewer.it.label} ({viewer.it.view} view) at {url}  (Ctrl-C to stop)")
            if on_ready:
                on_ready(url)
            server = uvicorn.Server(uvicorn.Config(make_app(viewer), log_level="warning", lifespan="off"))
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn shuts down on Ctrl-C, then raises it again for the caller: done
            pass
        finally:
            sock.close()
    echo("rlpipe view: stopped")
