"""The user's config folder: VRAMPLAN_CONFIG_DIR when set, else the platform's own
(platformdirs: ~/.config/vramplan on Linux, ~/Library/Application Support/vramplan on
macOS, %LOCALAPPDATA%\\vramplan on Windows). It holds gpus.toml (extra GPUs and prices)
and what `calibrate` learns."""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "VRAMPLAN_CONFIG_DIR"


def user_config_dir() -> Path:
    override = os.environ.get(ENV_VAR, "").strip()
    if override:
        return Path(override).expanduser()
    from platformdirs import user_config_path

    return user_config_path("vramplan", appauthor=False)
