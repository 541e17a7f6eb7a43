"""What a PNG the code drew shows: its coloured pixels (the data a plot draws: lines, bars,
points, filled contours in colour) as opposed to an empty plot's white background and its grey
and black axes, ticks, grid and labels."""
from __future__ import annotations

from pathlib import Path


def _coloured_mask(path: Path, min_chroma: float):
    import matplotlib.image

    image = matplotlib.image.imread(str(path))  # floats in [0, 1], RGB or RGBA
    rgb = image[..., :3]
    opaque = image[..., 3] > 0.5 if image.shape[-1] == 4 else True
    return ((rgb.max(axis=-1) - rgb.min(axis=-1)) > min_chroma) & opaque, rgb


def coloured_pixels(path: Path, *, min_chroma: float = 0.25) -> int:
    """Opaque pixels whose colour is far from grey (max - min of R, G, B above `min_chroma`)."""
    return int(_coloured_mask(path, min_chroma)[0].sum())


def coloured_pixels_per_band(path: Path, bands: int, *, min_chroma: float = 0.25) -> list[int]:
    """`coloured_pixels` of each of `bands` equal horizontal bands, top first (one per panel of
    a figure of panels stacked vertically)."""
    mask = _coloured_mask(path, min_chroma)[0]
    height = mask.shape[0]
    return [int(mask[i * height // bands:(i + 1) * height // bands].sum()) for i in range(bands)]


def pixels_near(path: Path, colour: str, *, tolerance: float = 0.08) -> int:
    """Pixels within `tolerance` (each of R, G, B) of a matplotlib colour ("C0", "#ff7f0e")."""
    import numpy as np
    from matplotlib.colors import to_rgb

    rgb = _coloured_mask(path, 0.0)[1]
    return int((np.abs(rgb - np.array(to_rgb(colour))) < tolerance).all(axis=-1).sum())


def bar_heights(path: Path, colour: str, *, tolerance: float = 0.08) -> list[int]:
    """Heights in pixels of the bars drawn in `colour`, left to right: each run of adjacent
    columns holding that colour is one bar, its height the most pixels of the colour in one of
    its columns."""
    import numpy as np
    from matplotlib.colors import to_rgb

    rgb = _coloured_mask(path, 0.0)[1]
    per_column = (np.abs(rgb - np.array(to_rgb(colour))) < tolerance).all(axis=-1).sum(axis=0)
    heights, current = [], 0
    for count in [*per_column.tolist(), 0]:
        if count:
            current = max(current, count)
        elif current:
            heights.append(current)
            current = 0
    return heights
