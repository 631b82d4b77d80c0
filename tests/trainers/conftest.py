import json
import random

import pytest


@pytest.fixture(scope="session")
def pairs_file(tmp_path_factory):
    """24 hand-made arithmetic preference pairs (the right sum chosen, a wrong one rejected) in
    RL2's two row shapes, some with a system prompt."""
    rng = random.Random(0)
    rows = []
    for i in range(24):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        wrong = str(a + b + rng.choice([-2, -1, 1, 3])) + (" maybe" if i % 3 == 0 else "")
        question = f"What is {a} + {b}?"
        if i % 4 == 0:
            prompt = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]}
        else:
            prompt = {"prompt": question}
        rows.append({**prompt, "chosen": str(a + b), "rejected": wrong})
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
