"""Procedural scenes for zoo:vlm-tiny: coloured shapes on a 3 x 3 grid, their description and
question/answer pairs, all determined by one seed.

A scene holds 1 to 4 shapes, each in its own grid cell (so "where" has one answer), with a
kind, a colour and a size. Its description says how many shapes there are, then one sentence
per shape in reading order (top left to bottom right), so a caption has one right wording.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IMAGE_SIZE = 128
KINDS = ("circle", "square", "triangle", "cross")
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles", "cross": "crosses"}
COLOURS = {  # saturated, far apart, and far from the light background
    "red": (220, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
    "purple": (140, 50, 170),
}
SIZES = {"small": 9.0, "large": 16.0}  # half-width in pixels; a grid cell is ~42.7 pixels wide
CELLS = ("top left", "top middle", "top right", "middle left", "centre", "middle right",
         "bottom left", "bottom middle", "bottom right")  # reading order
NUMBERS = ("none", "one", "two", "three", "four")
MAX_SHAPES = 4


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    size: str
    cell: int  # index into CELLS
    x: float  # centre, pixels from the left
    y: float  # centre, pixels from the top

    @property
    def where(self) -> str:
        return CELLS[self.cell]


@dataclass(frozen=True)
class Scene:
    seed: int
    shapes: tuple[Shape, ...]  # in reading order of their cells
    background: tuple[int, int, int]

    def image(self) -> np.ndarray:
        return draw(self)

    def description(self) -> str:
        return describe(self)

    def questions(self) -> list[tuple[str, str, str]]:
        return questions(self)


def make_scene(seed: int) -> Scene:
    """The scene of ``seed``: the same seed gives the same scene on every machine."""
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, MAX_SHAPES + 1))
    cells = sorted(int(c) for c in rng.choice(len(CELLS), size=count, replace=False))
    cell_size = IMAGE_SIZE / 3
    shapes = []
    for cell in cells:
        kind = KINDS[int(rng.integers(len(KINDS)))]
        colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
        size = list(SIZES)[int(rng.integers(len(SIZES)))]
        slack = cell_size / 2 - SIZES[size] - 2  # how far the shape may move and stay inside its cell
        row, col = divmod(cell, 3)
        x = (col + 0.5) * cell_size + float(rng.uniform(-slack, slack))
        y = (row + 0.5) * cell_size + float(rng.uniform(-slack, slack))
        shapes.append(Shape(kind, colour, size, cell, round(x, 2), round(y, 2)))
    background = tuple(int(v) for v in rng.integers(215, 256, size=3))
    return Scene(seed, tuple(shapes), background)


def _mask(shape: Shape, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Pixels inside ``shape`` ([H, W] bool); every kind spans about 2 half-widths across."""
    r = SIZES[shape.size]
    dx, dy = xs - shape.x, ys - shape.y
    if shape.kind == "circle":
        return dx * dx + dy * dy <= r * r
    if shape.kind == "square":
        side = 0.85 * r  # about the circle's area
        return (np.abs(dx) <= side) & (np.abs(dy) <= side)
    if shape.kind == "triangle":  # pointing up: half-width grows from 0 at the apex to r at the base
        down = (dy + r) / (2 * r)  # 0 at the apex, 1 at the base
        return (down >= 0) & (down <= 1) & (np.abs(dx) <= r * down)
    arm = r / 3  # cross: two bars
    return ((np.abs(dx) <= arm) & (np.abs(dy) <= r)) | ((np.abs(dy) <= arm) & (np.abs(dx) <= r))


def draw(scene: Scene) -> np.ndarray:
    """The scene as an RGB image, uint8 [IMAGE_SIZE, IMAGE_SIZE, 3]."""
    ys, xs = np.meshgrid(np.arange(IMAGE_SIZE) + 0.5, np.arange(IMAGE_SIZE) + 0.5, indexing="ij")  # [H, W] each
    image = np.empty((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    image[:] = scene.background
    for shape in scene.shapes:
        image[_mask(shape, xs, ys)] = COLOURS[shape.colour]
    return image


def _number(n: int) -> str:
    return NUMBERS[n]


def describe(scene: Scene) -> str:
    """E.g. "There are two shapes. A large red circle is in the top left. A small blue cross is in the centre." """
    n = len(scene.shapes)
    opening = "There is one shape." if n == 1 else f"There are {_number(n)} shapes."
    sentences = [f"A {s.size} {s.colour} {s.kind} is in the {s.where}." for s in scene.shapes]
    return " ".join([opening, *sentences])


def _answer(text: str) -> str:
    return text[0].upper() + text[1:] + "."


def questions(scene: Scene) -> list[tuple[str, str, str]]:
    """Every question the scene answers unambiguously: (kind of question, question, answer).
    Kinds: "count" (all shapes, a colour's, a kind's; absent ones answer "None."), "colour"
    (of a kind present once), "where" (of a kind, or a colour and kind, present once),
    "shape" (in an occupied cell)."""
    shapes = scene.shapes
    out = [("count", "How many shapes are there?", _answer(_number(len(shapes))))]
    for colour in COLOURS:
        n = sum(s.colour == colour for s in shapes)
        out.append(("count", f"How many {colour} shapes are there?", _answer(_number(n))))
    for kind in KINDS:
        of_kind = [s for s in shapes if s.kind == kind]
        out.append(("count", f"How many {PLURALS[kind]} are there?", _answer(_number(len(of_kind)))))
        if len(of_kind) == 1:
            out.append(("colour", f"What colour is the {kind}?", _answer(of_kind[0].colour)))
            out.append(("where", f"Where is the {kind}?", _answer(of_kind[0].where)))
        elif len(of_kind) > 1:
            for s in of_kind:
                if sum(t.colour == s.colour for t in of_kind) == 1:
                    out.append(("where", f"Where is the {s.colour} {kind}?", _answer(s.where)))
    for s in shapes:
        out.append(("shape", f"What shape is in the {s.where}?", _answer(f"a {s.size} {s.colour} {s.kind}")))
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m hasten.zoo.scenes SEED [SEED ...] --out DIR``: write scenes as PNG files (to
    try a VLM on) and print each one's description."""
    import argparse
    from pathlib import Path

    from PIL import Image

    parser = argparse.ArgumentParser(prog="python -m hasten.zoo.scenes", description=main.__doc__)
    parser.add_argument("seeds", nargs="+", type=int, metavar="SEED", help="one scene per seed (>= 0)")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for scene-SEED.png (default: here)")
    args = parser.parse_args(argv)
    if any(seed < 0 for seed in args.seeds):
        parser.error("seeds must be >= 0")
    args.out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        scene = make_scene(seed)
        path = args.out / f"scene-{seed}.png"
        Image.fromarray(scene.image()).save(path)
        print(f"{path}: {scene.description()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
