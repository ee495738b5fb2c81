"""The SWE verifier's test harness: runs pytest in the sandbox and reports each test's result on a
pipe the host opened, never through a file the tested code could write.

    python -I -S -B swe_harness.py PYTEST_ARGS... < {"fd": N, "nonce": "...", "sys_path": [...]}

Run by path in isolated mode without `site` (no sitecustomize, usercustomize, .pth files, user
site, PYTHON* variables), so only the standard library and the host's site-packages directories
(passed in, not discovered) are importable before pytest starts. The configuration arrives on
standard input, read before any tested code is imported; the pipe's descriptor is moved to
another number and made non-inheritable, so processes the tests start do not have it.

Protocol: one JSON line per test phase report `{"node", "when", "outcome", "h"}` and a final
`{"end": exit status, "count": records, "h"}`, where `h` chains sha256 over the nonce and every
line before it. The host accepts only an unbroken chain ending in `end`: a record injected by
the tested code breaks the chain, a run cut short (os._exit, a killed process) has no `end`,
and the JUnit report, the exit status and stdout are never consulted.
"""

import hashlib
import json
import os
import sys

_write = os.write  # bound before tested code can monkeypatch os
_sha256 = hashlib.sha256
_dumps = json.dumps


class _Reporter:
    def __init__(self, fd: int, nonce: str) -> None:
        self._fd, self._h, self.count = fd, _sha256(nonce.encode()).hexdigest(), 0

    def emit(self, record: dict) -> None:
        body = _dumps(record, sort_keys=True)
        self._h = _sha256((self._h + body).encode()).hexdigest()
        line = _dumps({**record, "h": self._h}, sort_keys=True) + "\n"
        data = line.encode()
        while data:
            data = data[_write(self._fd, data):]
        self.count += 1

    def pytest_runtest_logreport(self, report) -> None:
        outcome = report.outcome
        if getattr(report, "wasxfail", None) is not None:
            outcome = "skipped"  # an expected failure is not a pass
        self.emit({"node": report.nodeid, "when": report.when, "outcome": outcome})


def main() -> int:
    cfg = json.loads(sys.stdin.readline())
    fd = os.dup(int(cfg["fd"]))
    os.close(int(cfg["fd"]))
    os.set_inheritable(fd, False)
    sys.path.extend(str(p) for p in cfg.get("sys_path", []))
    reporter = _Reporter(fd, str(cfg["nonce"]))
    del cfg
    import pytest

    code = pytest.main(sys.argv[1:], plugins=[reporter])
    reporter.emit({"end": int(code), "count": reporter.count})
    os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
