"""Your own evaluation loop: an rl2gem env from gym.make, a model behind any OpenAI-compatible API.

    .venv/bin/python -m rl2gem.serve --model smollm2-135m-instruct --port 30000 &
    .venv/bin/python examples/eval_with_openai_client.py --base-url http://127.0.0.1:30000/v1

Nothing of rl2gem is used beyond the env (and ``standard_kwargs``, which passes ``--split`` to the
envs that take one): the model is whatever the server runs (rl2gem.serve,
SGLang, vLLM, a hosted API; the key comes from OPENAI_API_KEY), and the loop is a plain
Gymnasium loop. Each turn sends the whole conversation; the env's reply is the next user message.
"""

import argparse
import os

import gymnasium as gym
from openai import OpenAI

import rl2gem  # noqa: F401  (registers the rl2/ envs with Gymnasium)
from rl2gem.registry import standard_kwargs

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:30000/v1"))
parser.add_argument("--model", default=None, help="default: the first model the server lists")
parser.add_argument("--env", default="rl2/SearchQA-v0")
parser.add_argument("--episodes", type=int, default=5)
parser.add_argument("--max-tokens", type=int, default=48)
parser.add_argument(
    "--max-turns", type=int, default=None, help="a multi-turn env's turn limit (default: its own; games, search...)"
)
parser.add_argument("--split", default="test", help="the data split, for envs that have one")
args = parser.parse_args()
# split= goes only to envs that take one (a data set's), as python -m rl2gem.evaluate passes it
kwargs = standard_kwargs(args.env, {"max_turns": args.max_turns} if args.max_turns else {}, split=args.split)
try:  # the env's own arguments refused (a single-turn env has no --max-turns): one line, not a traceback
    gym.make(args.env, **kwargs).close()
except (TypeError, ValueError, gym.error.Error) as error:
    parser.error(f"{args.env}: {error}")

client = OpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"), max_retries=5)
model = args.model or client.models.list().data[0].id

rewards = []
for episode in range(args.episodes):
    env = gym.make(args.env, **kwargs)
    # a data-set env (len(env)) plays its items in order, so two models see the same questions
    options = {"index": episode % len(env.unwrapped)} if hasattr(env.unwrapped, "__len__") else None
    observation, info = env.reset(seed=episode, options=options)
    messages = [{"role": "user", "content": observation}]
    total, done = 0.0, False
    while not done:
        reply = client.chat.completions.create(
            model=model, messages=messages, max_tokens=args.max_tokens, temperature=0.0
        )
        action = reply.choices[0].message.content or ""
        observation, reward, terminated, truncated, info = env.step(action)
        messages += [{"role": "assistant", "content": action}, {"role": "user", "content": observation}]
        total += reward
        done = terminated or truncated
    env.close()
    rewards.append(total)
    print(f"episode {episode}: reward {total:.2f} after {info['turn']} turns; last action {action[:60]!r}")
print(f"{args.env} with {model}: mean reward {sum(rewards) / len(rewards):.3f} over {len(rewards)} episodes")
