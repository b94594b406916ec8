"""The paper's number beside each claim it makes, by claim text (experiments/claims.py's `paper` column).

From ../shared/PAPER.md's headline table: Qwen3-8B, Pass@1 in points averaged over MATH-500,
AIME24, AIME25, AMC23 and OlympiadBench, EBPO minus the baseline (its G=4 EBPO row is
EBPO-topic). The toy's effects are in pass@1 (0.01 = 1 point). `direction only`: the paper
makes the claim, PAPER.md gives no number for it; a claim absent here is not the paper's.
Kept out of the claims files, which are hashed at registration and never edited.
"""

PAPER = {
    "EBPO beats GRPO at G=2": "none (its G starts at 4)",
    "EBPO beats GRPO at G=4": "+5.67 (EBPO-topic)",
    "EBPO beats GRPO at G=8": "+11.28",
    "EBPO beats GRPO at G=16": "+1.48",
    "the gain shrinks with G: (EBPO - GRPO at G=4) - (at G=16)": "+4.19 (G=4 EBPO-topic)",
    "the gain shrinks with G: (EBPO - GRPO at G=2) - (at G=16)": (
        "+4.19 (G=4 EBPO-topic - G=16; the paper has no G=2)"
    ),
    "the gain shrinks with G: (EBPO - GRPO at G=2) - (at G=8)": (
        "-5.61 (G=4 EBPO-topic - G=8; the paper has no G=2)"
    ),
    "EBPO beats Dr. GRPO at G=4": "+7.72 (EBPO-topic)",
    "EBPO beats DAPO at G=4": "+11.76 (EBPO-topic)",
    "EBPO - GRPO at G=4": "+5.67 (EBPO-topic)",
    "EBPO - DAPO at G=4": "+11.76 (EBPO-topic)",
    "EBPO beats Clip-Cov at G=4": "direction only",
    "EBPO-topic beats EBPO-naive": "direction only",
    "EBPO-diff beats EBPO-naive": "direction only",
    "one epoch: EBPO-diff beats EBPO-naive": "direction only",
    "one epoch: EBPO-diff (easy to hard by the warm start's pass rate) beats EBPO-naive": (
        "direction only"
    ),
}
# The same claim read another way (over warm starts, at each method's best rate, longer).
PREFIXES = (
    "across warm starts: ",
    "best rate: ",
    "fixed rate 3e-5 (second view): ",
    "2x steps: ",
    "4x steps: ",
)


def number(claim: str) -> str:
    """The paper's number for `claim` ("-" when the paper makes no such claim)."""
    for prefix in PREFIXES:
        claim = claim.removeprefix(prefix)
    return PAPER.get(claim, "-")
