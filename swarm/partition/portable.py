"""PortableConfig: a model config in a plain object, free of imports, so that layers.py and config.py can both name
it (config.py imports the families, whose layers take one)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class PortableConfig(SimpleNamespace):
    """A model config's attributes, as transformers' config class for the family left them (defaults filled in,
    rope parameters standardised), in a plain object. A Ray driver reads the config once and hands this to its
    actors: it unpickles without importing transformers, which a restarted training stage replica would otherwise
    import first (about 0.7 s of a fresh process on an idle core, and in the family's config module about 1.1 s
    more; two to three times that beside a training run), before it serves again."""

    model_type: str

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))
