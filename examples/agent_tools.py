"""The agent demo's tool (examples/agent.yaml): the tiny model cannot add, the tool can."""


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first addend
        b: second addend
    """
    return a + b
