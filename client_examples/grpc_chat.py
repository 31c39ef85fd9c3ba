"""Streaming chat with the Triton `llm` model over gRPC.

The model takes raw text, so this client keeps the conversation and renders it as ChatML
(SmolLM2-Instruct's template) for every turn; the reply streams to the terminal as it arrives.

  python client_examples/grpc_chat.py                       # interactive; /reset, /exit
  python client_examples/grpc_chat.py --prompt "Hi there"   # one turn, then exit
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python client_examples/grpc_chat.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client_examples.common import (  # noqa: E402
    DEFAULT_SYSTEM_PROMPT, ChatMessage, GrpcStreamSession, clean_assistant_reply, format_chatml, sampling_parameters,
)


class ChatSession:
    """Conversation history plus the stream it is sent over."""

    def __init__(self, stream: GrpcStreamSession, system_prompt: str, sampling: dict):
        self.stream = stream
        self.sampling = sampling
        self.system = [ChatMessage("system", system_prompt)] if system_prompt else []
        self.history: list[ChatMessage] = []

    def reset(self) -> None:
        self.history.clear()

    def ask(self, user_text: str, out=None) -> str:
        out = out or sys.stdout  # looked up per call so redirected/captured stdout is honoured
        turn = self.history + [ChatMessage("user", user_text)]
        prompt = format_chatml(self.system + turn)

        def show(chunk):
            out.write(chunk.text)
            out.flush()

        record = self.stream.generate(prompt, self.sampling, on_chunk=show)
        out.write("\n")
        if not record.ok:
            # The failed turn is not kept, so the user can retry it.
            raise RuntimeError(record.error)
        reply = clean_assistant_reply(record.text)
        self.history = turn + [ChatMessage("assistant", reply)]
        reason = next((c.finish_reason for c in reversed(record.chunks) if c.finish_reason), None)
        if reason == "length":
            print("[reply cut at --max-tokens]", file=sys.stderr)
        return reply


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="localhost:8001", help="Triton gRPC address (host:port)")
    p.add_argument("--model", default="llm")
    p.add_argument("--prompt", help="ask this once and exit instead of an interactive session")
    p.add_argument("--system", default=DEFAULT_SYSTEM_PROMPT, help="system prompt ('' for none)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=None)
    args = p.parse_args(argv)

    stream = GrpcStreamSession(args.url, args.model)
    chat = ChatSession(stream, args.system,
                       sampling_parameters(args.max_tokens, args.temperature, top_p=args.top_p))
    try:
        if args.prompt is not None:
            try:
                chat.ask(args.prompt)
            except RuntimeError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            return 0
        print("chat with the model; /reset clears history, /exit or Ctrl-D quits", file=sys.stderr)
        while True:
            try:
                line = input("you> ").strip()
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return 0
            if not line:
                continue
            if line in ("/exit", "/quit"):
                return 0
            if line == "/reset":
                chat.reset()
                print("[history cleared]", file=sys.stderr)
                continue
            sys.stdout.write("assistant> ")
            try:
                chat.ask(line)
            except RuntimeError as e:
                print(f"error: {e}", file=sys.stderr)
            except KeyboardInterrupt:
                print("\n[interrupted]", file=sys.stderr)
    finally:
        stream.close()


if __name__ == "__main__":
    sys.exit(main())
