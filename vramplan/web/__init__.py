"""The local web app (FastAPI): `create_app()`, served by `vramplan serve`.

Needs the `web` extra (fastapi, uvicorn). Nothing here holds engine logic: the routes call
the engine registry, vramplan.search and vramplan.views.
"""

from vramplan.web.app import create_app
from vramplan.web.server import serve, server_url

__all__ = ["create_app", "serve", "server_url"]
