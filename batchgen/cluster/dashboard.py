"""Registering the `batchgen` page on the scheduler's dashboard (`/batchgen`, listed in the
dashboard's "More..." menu), the way distributed adds its own pages: a Bokeh application
(`distributed.dashboard.core.BokehApplication`) added to the scheduler's HTTP application.
The balance plugin registers it in `start()` and removes it in `close()`.

Bokeh stays optional: without it (or without a dashboard) `register` returns None, imports
nothing heavy, and the plugin works as before. Design: docs/guides/dashboard.md.
"""
from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .dashboard_data import LoadView

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)

PAGE = "/batchgen"
MENU_ENTRY = {"url": PAGE.strip("/"), "name": "batchgen"}


@dataclass(slots=True)
class PageRegistration:
    scheduler: Scheduler
    app: Any  # the page's BokehTornado
    plots: list[dict[str, str]]  # the dashboard's "More..." menu, shared by its pages
    state: Any  # dashboard_page.PageState: the sessions' shared history and jobs


def register(scheduler: Scheduler, plugin: LoadView) -> PageRegistration | None:
    """Add the page to `scheduler`'s dashboard; None when it has none or bokeh is missing."""
    # distributed imports its dashboard module only when it serves a dashboard with bokeh
    # installed; checking for it first keeps a dashboard-less scheduler from importing bokeh
    if "distributed.dashboard.scheduler" not in sys.modules or getattr(scheduler, "http_application", None) is None:
        return None
    try:
        from bokeh.server.server import BokehTornado
        from distributed.dashboard import scheduler as dask_pages
        from distributed.dashboard.core import BokehApplication
        from tornado.ioloop import IOLoop

        from .dashboard_page import PageState, batchgen_doc
    except ImportError as exc:
        logger.debug("no batchgen dashboard page: %s", exc)
        return None
    http = scheduler.http_application
    dask_app = next((a for a in http.applications if isinstance(a, BokehTornado)), None)
    if dask_app is None:
        return None
    if any(isinstance(a, BokehTornado) and PAGE in a.app_paths for a in http.applications):
        return None  # a second plugin in this scheduler: the first one's page stays
    variables = dask_pages.template_variables(scheduler)  # memoized: the dict Dask's pages render
    state = PageState(plugin)
    page = functools.partial(batchgen_doc, state)
    app = BokehApplication({PAGE: page}, scheduler, prefix=dask_app.prefix, template_variables=variables)
    http.add_application(app)
    app.initialize(IOLoop.current())
    app.start()
    plots: list[dict[str, str]] = variables["plots"]
    if MENU_ENTRY not in plots:
        plots.append(dict(MENU_ENTRY))
        plots.sort(key=lambda d: d["name"])  # as Dask sorts it
    return PageRegistration(scheduler, app, plots, state)


def unregister(reg: PageRegistration) -> None:
    """Take the page and its menu entry off the dashboard; open sessions stop updating."""
    http = reg.scheduler.http_application
    if reg.app in http.applications:
        http.applications.remove(reg.app)
    try:
        reg.app.stop(wait=False)
    except Exception as exc:  # noqa: BLE001 - the scheduler may be closing its loop already
        logger.debug("stopping the batchgen page failed: %s", exc)
    if MENU_ENTRY in reg.plots:
        reg.plots.remove(MENU_ENTRY)
