"""Prints the README's set-up commands, one a line, so that CI runs exactly what the README says.

They are the lines of the first ```bash block under "## Set up and run", without their trailing comments:
one runs the main job, one the test suite. Anything else there is an error, so the two cannot drift apart.
"""

import re
import sys


def readme_commands(text: str) -> list[str]:
    section = text.split("\n## Set up and run", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines() if line.strip()]
    if len(commands) != 2 or not commands[0].endswith("python demo.py") or "pytest" not in commands[1]:
        raise SystemExit(f"README set-up block: expected the main job then the test suite. Found: {commands}")
    return commands


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as readme:
        print("\n".join(readme_commands(readme.read())))
