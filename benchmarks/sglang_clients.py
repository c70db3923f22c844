"""SGLang's own client code (the `sglang` wheel, unchanged) against `prefixrt serve`: what it needs beside the
wheel, and the frontend-language program that is run through `sgl.RuntimeEndpoint`.

    python benchmarks/sglang_clients.py dataset /tmp/sglang_run/sharegpt_small.json
    python benchmarks/sglang_clients.py stand-in /tmp/sglang_shims
    python benchmarks/sglang_clients.py program http://127.0.0.1:30001

`dataset`: a small ShareGPT-format file (ten two-turn conversations written here), so that bench_serving's and
bench_multiturn's `random` dataset (token ids sampled from ShareGPT prompts) reads a local file instead of
downloading ShareGPT.
`stand-in`: an import-time torchvision package. sglang's client modules import its multimodal configs, which
import torchvision at module level; the only torchvision wheel on the index is built against CUDA torch and cannot
load beside torch+cpu. The stand-in answers every `from torchvision... import name` with a placeholder that raises
when called; nothing on the client paths calls one.
`program`: an `sgl.function` program (select, fork into two gens, gen; `run_batch`; a chat turn) through
`sgl.RuntimeEndpoint`, printing what it read. The chat template is named (`chatml`, the embedded chat model's):
RuntimeEndpoint guesses one from /get_model_info's `model_path`, and its guesses do not cover a local folder of
that name. Commands and numbers: docs/benchmarks.md, "SGLang's own clients against prefixrt serve".
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

TOPICS = ["the water cycle", "how a radix tree stores strings", "why the sky is blue", "baking bread at home",
          "the history of the printing press", "how vaccines train the immune system", "plate tectonics",
          "what a hash table is", "photosynthesis in plants", "the rules of chess"]

STAND_IN = '''"""Import-time stand-in for torchvision (benchmarks/sglang_clients.py in prefixrt): any use raises."""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0"


class _Placeholder:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is not installed (import-time stand-in)")

    def __mro_entries__(self, bases):
        return (object,)


def _module_getattr(module_name):
    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{module_name}.{attr}")
    return __getattr__


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Submodules())
__getattr__ = _module_getattr("torchvision")
'''


def write_dataset(path: Path) -> None:
    rows = [{"id": f"conv{i}", "conversations": [
        {"from": "human", "value": f"Please explain {topic} in a few sentences, as you would to a curious student."},
        {"from": "gpt", "value": f"Here is a short explanation of {topic}. " * 6}]} for i, topic in enumerate(TOPICS)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1))


def write_stand_in(folder: Path) -> None:
    (folder / "torchvision").mkdir(parents=True, exist_ok=True)
    (folder / "torchvision" / "__init__.py").write_text(STAND_IN)


def run_program(url: str, chat_template: str) -> None:
    import sglang as sgl

    @sgl.function
    def trip(s, city):
        s += f"Question: Plan a short day in {city}.\n"
        s += "Is it a big city? " + sgl.select("big", choices=["yes", "no"]) + "\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Idea {i + 1}: " + sgl.gen("idea", max_tokens=12, stop="\n", temperature=0)
        s += "Ideas: " + " | ".join(f["idea"] for f in forks) + "\n"
        s += "Summary: " + sgl.gen("summary", max_tokens=16, temperature=0)

    @sgl.function
    def chat_turn(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=16, temperature=0))

    endpoint = sgl.RuntimeEndpoint(url, chat_template_name=chat_template)
    sgl.set_default_backend(endpoint)
    print("chat template:", endpoint.get_chat_template().name)
    t0 = time.perf_counter()
    state = trip.run(city="Paris")
    print("select big:", repr(state["big"]))
    print("fork ideas:", repr(next(line for line in state.text().splitlines() if line.startswith("Ideas: "))))
    print("summary:", repr(state["summary"]))
    print("meta:", state.get_meta_info("summary"))
    for st in trip.run_batch([{"city": "Lyon"}, {"city": "Oslo"}], num_threads=2):
        print("batch:", repr(st["big"]), repr(st["summary"]))
    print("chat answer:", repr(chat_turn.run(question="What is the capital of France?")["answer"]))
    print(f"program wall time: {time.perf_counter() - t0:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("dataset").add_argument("path", type=Path)
    sub.add_parser("stand-in").add_argument("folder", type=Path)
    program = sub.add_parser("program")
    program.add_argument("url")
    program.add_argument("--chat-template", default="chatml")
    args = parser.parse_args()
    if args.command == "dataset":
        write_dataset(args.path)
    elif args.command == "stand-in":
        write_stand_in(args.folder)
    else:
        run_program(args.url, args.chat_template)


if __name__ == "__main__":
    main()
