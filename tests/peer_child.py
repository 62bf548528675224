"""The other process of test_peer_gpu.py's export test: receives a pool's chunks over the Unix socket whose
descriptor is its argument, checks what the parent wrote, writes its own pattern, and says so.

    python3 tests/peer_child.py SOCKET_FD
"""

import socket
import sys

import numpy as np

from pagedrt.memory import receive_chunks


def pattern(n, a, b):
    return (np.arange(n, dtype=np.uint64) * a + b).astype(np.uint32)


def main(fd):
    with socket.socket(fileno=fd) as sock:
        with receive_chunks(sock) as chunks:
            n = chunks.size // 4
            view = chunks.view(0, n, np.uint32)
            if not np.array_equal(view.get(), pattern(n, 3, 1)):
                sock.sendall(b"read wrong")
                return 1
            view[...] = chunks.xp.asarray(pattern(n, 7, 5))
            chunks.synchronize()
            del view
        sock.sendall(b"wrote")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
