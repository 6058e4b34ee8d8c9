"""A prompt exit for every process that imports RaySwarm.

Most of the time a Python process spends exiting after a script's last line goes to the cyclic garbage collector
walking the millions of objects torch, transformers and hivemind leave behind (measured here: 0.6 s for `import
torch` alone, 1.3-1.7 s for a client script after generate). Freezing the collector at exit moves every object out
of its reach, so the interpreter's final collections skip that walk; reference counting still releases what it can
and the OS takes back the rest. atexit handlers run last-in, first-out: registered at import, this runs after those
of everything imported later, which may still allocate freely. Measured: 1.3-1.6 s -> 0.3-0.4 s from a client's
last output to its exit.
"""

from __future__ import annotations

import atexit
import gc

atexit.register(gc.freeze)
