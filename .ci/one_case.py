"""Write .ci/one-case.txt from a JUnit XML of a whole-suite run: the test functions with more
than one case whose cases took at least THRESHOLD seconds together and 0.5 s each on average
(many cheap cases, such as the autocast op tables, are what differs between torch versions).
.ci/matrix runs only the first case of each on the non-primary torch versions (tests/conftest.py,
AMP_FX_ONE_CASE); the primary runs them all.

    python -m pytest -q -p no:cacheprovider -m "not models_slow and not primary" tests --junitxml=run.xml
    python .ci/one_case.py run.xml [THRESHOLD=2]
"""

import collections
import sys
import xml.etree.ElementTree as ET

junit, threshold = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
cases: dict[str, list[float]] = collections.defaultdict(list)
for case in ET.parse(junit).getroot().iter("testcase"):
    path = case.get("classname", "").replace(".", "/") + ".py"
    cases[f"{path}::{case.get('name', '').split('[')[0]}"].append(float(case.get("time", 0)))
slow = sorted((k for k, v in cases.items()
               if len(v) > 1 and sum(v) >= threshold and sum(v) / len(v) >= 0.5), key=lambda k: -sum(cases[k]))
with open(".ci/one-case.txt", "w") as f:
    f.write(f"# Written by .ci/one_case.py from a whole-suite run (threshold {threshold:g} s): test functions\n"
            f"# whose cases run once (the first) on the non-primary torch versions. Seconds: all cases.\n")
    for k in slow:
        f.write(f"{k}  # {sum(cases[k]):.0f} s, {len(cases[k])} cases\n")
print(f"{len(slow)} functions; matrix time about "
      f"{sum(sum(v) for k, v in cases.items() if k not in slow) + sum(cases[k][0] for k in slow):.0f} s "
      f"of {sum(sum(v) for v in cases.values()):.0f} s")
