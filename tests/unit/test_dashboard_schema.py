"""The dashboards type-check against Grafana's own dashboard schema: the TypeScript types that @grafana/schema
(pinned in dashboards/schema-check, installed by `make test` when npm is on the machine) generates from Grafana's
CUE schema. Each dashboard is an object literal typed `Dashboard` (so unknown fields fail too), and the stat and
heatmap panels' options are typed with those panels' `Options`. Enums are compared by their string values."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CHECK_DIR = REPO_ROOT / ".cache" / "grafana-schema"
TSC = CHECK_DIR / "node_modules" / "typescript" / "bin" / "tsc"
PANELS = "./node_modules/@grafana/schema/dist/types/raw/composable/{}/panelcfg/x/types.gen"
OPTIONS = {"heatmap": "HeatmapOptions", "stat": "StatOptions"}

pytestmark = pytest.mark.skipif(
    not TSC.is_file() or shutil.which("node") is None, reason="Grafana's schema types are not installed (make test)"
)


def typed_source(dashboards: list[Path]) -> str:
    lines = [
        'import type { Dashboard } from "@grafana/schema";',
        *(f'import type {{ Options as {name} }} from "{PANELS.format(kind)}";' for kind, name in OPTIONS.items()),
        # Grafana's enums, as the unions of their string values that JSON holds.
        "type Loose<T> = T extends string ? `${T}` : T extends object ? { [K in keyof T]: Loose<T[K]> } : T;",
    ]
    for index, path in enumerate(dashboards):
        text = path.read_text()
        lines.append(f"export const dashboard{index}: Dashboard = {text};")
        for number, panel in enumerate(json.loads(text)["panels"]):
            if panel["type"] in OPTIONS and "options" in panel:
                options = json.dumps(panel["options"])
                lines.append(f"export const options{index}_{number}: Loose<{OPTIONS[panel['type']]}> = {options};")
    return "\n".join(lines) + "\n"


def test_dashboards_type_check_against_grafanas_schema() -> None:
    dashboards = sorted((REPO_ROOT / "dashboards").glob("*.json"))
    (CHECK_DIR / "check.ts").write_text(typed_source(dashboards))
    shutil.copy(REPO_ROOT / "dashboards" / "schema-check" / "tsconfig.json", CHECK_DIR / "tsconfig.json")
    result = subprocess.run(
        ["node", str(TSC), "-p", str(CHECK_DIR)], capture_output=True, text=True, timeout=180, cwd=CHECK_DIR
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
