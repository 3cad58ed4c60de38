"""The API's documentation page, made from the generated OpenAPI document (offline, no JS)."""

from __future__ import annotations

import json
from typing import Any

from vramplan.views.html import Section, esc, page_html, table_html


def api_docs_html(spec: dict[str, Any]) -> str:
    """Every operation (method, path, what it does, its parameters and body), then every
    schema as JSON. The machine-readable document is /openapi.json."""
    rows = []
    for path, methods in spec.get("paths", {}).items():
        for method, op in methods.items():
            params = ", ".join(f"{p['name']} ({p['in']})" for p in op.get("parameters", []))
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            ref = body.get("schema", {}).get("$ref", "").rsplit("/", 1)[-1]
            codes = ", ".join(sorted(op.get("responses", {})))
            rows.append((method.upper(), path, op.get("description") or op.get("summary", ""),
                         ", ".join(x for x in (params, ref and f"body: {ref}") if x), codes))
    operations = Section("Operations", table_html(
        ("method", "path", "what it does", "inputs", "status codes"), rows)
        + "<p>Errors are JSON: <code>{\"error\": ..., \"errors\": [{\"field\", \"message\"}]}"
          "</code> with a 4xx code. The OpenAPI document is <code>/openapi.json</code>.</p>",
        "operations")
    schemas = Section("Schemas", "".join(
        f"<h3 id=\"{esc(name)}\">{esc(name)}</h3><pre>{esc(json.dumps(schema, indent=2))}</pre>"
        for name, schema in spec.get("components", {}).get("schemas", {}).items()), "schemas")
    info = spec.get("info", {})
    return page_html(f"{info.get('title', 'API')} API v{info.get('version', '')}",
                     [operations, schemas], subtitle=info.get("description", ""))
