"""The model presets of bench/models.json for the Python sides of the benchmarks.

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from models import preset
    cfg = preset("100m", max_position_embeddings=1024)   # a fresh dict: the preset, then the keys given
"""
import json
import os

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models.json")


def preset(name, **extra):
    """The Hugging Face config of preset NAME with EXTRA's keys added (or replaced)."""
    with open(PATH, encoding="utf-8") as f:
        cfg = dict(json.load(f)[name])
    cfg.update(extra)
    return cfg
