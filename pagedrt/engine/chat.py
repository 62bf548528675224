"""A user's message in ChatML, the chat format of SmolLM2 and many other models (``<|im_start|>role ...``).

GGUF files carry their chat template as Jinja; the engine does not run Jinja. It
writes ChatML itself, with the system message the template puts first by default
when it names one.
"""

import re

_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", re.S)


def chatml(message, template=""):
    """``message`` as one user turn, then the assistant's turn opened; the template's default system message
    first when it has one."""
    found = _DEFAULT_SYSTEM.search(template)
    system = f"<|im_start|>system\n{found.group(1)}<|im_end|>\n" if found else ""
    return f"{system}<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"
