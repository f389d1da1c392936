"""A small real code task for the `code_tests` reward: 30 problems, a correct and a wrong solution each.

Written for rlpipe's tests, docs and benchmark (no dataset is downloaded). The tests use the formats
real code-RL data uses (`rlpipe.rewards.code.cases`): 16 stdin/stdout problems (APPS/CodeContests
shape), 8 call-based ones (APPS ``fn_name`` shape, 2 of them LiveCodeBench "functional" items with
a LeetCode ``class Solution``) and 6 assert-style ones (MBPP asserts, a HumanEval ``check``). Each
wrong solution is a plausible bug (an edge case, an off-by-one, a tuple where a tuple is expected
and a list is returned), and fails at least one test.

`write_prompt_file(path)` writes them as a prompt file for ``prepare`` (``source: files``): columns
``prompt``, ``tests`` (a JSON string or Python source), and ``fn_name`` / ``entry_point`` where the
format needs them; those extra columns reach the reward as ``sample.metadata``.
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["PROBLEMS", "completion", "prompt_rows", "write_prompt_file"]


def _stdin(name, prompt, inputs, outputs, correct, wrong, fmt="apps"):
    tests = {"inputs": inputs, "outputs": outputs} if fmt == "apps" else {"input": inputs, "output": outputs}
    return {"id": name, "kind": "stdin", "prompt": prompt, "tests": json.dumps(tests), "correct": correct,
            "wrong": wrong}


def _call(name, prompt, fn, inputs, outputs, correct, wrong):
    return {"id": name, "kind": "call", "prompt": prompt, "fn_name": fn,
            "tests": json.dumps({"inputs": inputs, "outputs": outputs, "fn_name": fn}), "correct": correct,
            "wrong": wrong}


def _functional(name, prompt, fn, items, correct, wrong):
    tests = [{"input": "\n".join(json.dumps(a) for a in args), "output": json.dumps(out), "testtype": "functional"}
             for args, out in items]
    return {"id": name, "kind": "call", "prompt": prompt, "fn_name": fn, "tests": json.dumps(tests),
            "correct": correct, "wrong": wrong}


def _asserts(name, prompt, tests, correct, wrong, entry_point=None):
    row = {"id": name, "kind": "assert", "prompt": prompt, "tests": tests, "correct": correct, "wrong": wrong}
    if entry_point:
        row["entry_point"] = entry_point
    return row


PROBLEMS = [
    _stdin("sum_two", "Read two integers a and b on one line and print a + b.",
           ["1 2\n", "-5 3\n", "1000000000 1000000000\n"], ["3\n", "-2\n", "2000000000\n"],
           "a, b = map(int, input().split())\nprint(a + b)\n",
           "a, b = map(int, input().split())\nprint(abs(a) + abs(b))\n"),
    _stdin("max_of_list", "The first line holds n, the second n integers. Print the largest.",
           ["3\n1 5 2\n", "2\n-7 -3\n", "1\n0\n"], ["5\n", "-3\n", "0\n"],
           "input()\nprint(max(map(int, input().split())))\n",
           "input()\nbest = 0\nfor x in map(int, input().split()):\n    best = max(best, x)\nprint(best)\n"),
    _stdin("count_vowels", "Print how many vowels (a, e, i, o, u, either case) the input line holds.",
           ["hello\n", "AEIOU xyz\n", "rhythm\n"], ["2\n", "5\n", "0\n"],
           "print(sum(c in 'aeiouAEIOU' for c in input()))\n",
           "print(sum(c in 'aeiou' for c in input()))\n"),
    _stdin("reverse_words", "Print the words of the input line in reverse order, separated by single spaces.",
           ["one two three\n", "a\n", "x  y\n"], ["three two one\n", "a\n", "y x\n"],
           "print(' '.join(reversed(input().split())))\n",
           "print(input()[::-1])\n"),
    _stdin("fizzbuzz", "Given n, print the numbers 1..n, one per line, but Fizz for multiples of 3, Buzz for "
           "multiples of 5 and FizzBuzz for multiples of both.",
           ["5\n", "15\n"], ["1\n2\nFizz\n4\nBuzz\n", "\n".join(
               "FizzBuzz" if i % 15 == 0 else "Fizz" if i % 3 == 0 else "Buzz" if i % 5 == 0 else str(i)
               for i in range(1, 16)) + "\n"],
           "for i in range(1, int(input()) + 1):\n    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 "
           "else 'Buzz' if i % 5 == 0 else i)\n",
           "for i in range(1, int(input()) + 1):\n    print('Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 "
           "else 'FizzBuzz' if i % 15 == 0 else i)\n"),
    _stdin("primes", "The first line holds t; each of the next t lines an integer n >= 1. For each, print YES if "
           "n is prime, else NO.", ["3\n2\n9\n13\n", "2\n1\n97\n"], ["YES\nNO\nYES\n", "NO\nYES\n"],
           "def prime(n):\n    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))\n"
           "for _ in range(int(input())):\n    print('YES' if prime(int(input())) else 'NO')\n",
           "def prime(n):\n    return all(n % d for d in range(2, int(n ** 0.5) + 1))\n"
           "for _ in range(int(input())):\n    print('YES' if prime(int(input())) else 'NO')\n", fmt="codecontests"),
    _stdin("gcd_lcm", "Read two positive integers and print their greatest common divisor and least common "
           "multiple, separated by a space.", ["4 6\n", "7 5\n", "12 12\n"], ["2 12\n", "1 35\n", "12 12\n"],
           "from math import gcd\na, b = map(int, input().split())\nprint(gcd(a, b), a * b // gcd(a, b))\n",
           "from math import gcd\na, b = map(int, input().split())\nprint(gcd(a, b), a * b)\n"),
    _stdin("palindrome", "Print YES if the input line reads the same backwards, ignoring case, else NO.",
           ["Level\n", "abc\n", "a\n"], ["YES\n", "NO\n", "YES\n"],
           "s = input().strip().lower()\nprint('YES' if s == s[::-1] else 'NO')\n",
           "s = input().strip()\nprint('YES' if s == s[::-1] else 'NO')\n"),
    _stdin("prefix_sums", "The first line holds n, the second n integers. Print their prefix sums on one line.",
           ["4\n1 2 3 4\n", "1\n-5\n"], ["1 3 6 10\n", "-5\n"],
           "from itertools import accumulate\ninput()\nprint(*accumulate(map(int, input().split())))\n",
           "input()\nxs = list(map(int, input().split()))\nprint(*[sum(xs[:i]) for i in range(1, len(xs))])\n"),
    _stdin("transpose", "The first line holds r and c, then r lines of c integers. Print the transposed matrix.",
           ["2 3\n1 2 3\n4 5 6\n", "1 1\n7\n"], ["1 4\n2 5\n3 6\n", "7\n"],
           "r, c = map(int, input().split())\nm = [input().split() for _ in range(r)]\n"
           "for row in zip(*m):\n    print(*row)\n",
           "r, c = map(int, input().split())\nfor _ in range(r):\n    print(input())\n"),
    _stdin("mean", "The first line holds n, the second n integers. Print their mean (an absolute or relative "
           "error of 1e-6 is accepted).", ["3\n1 2 4\n", "2\n1 2\n"], ["2.333333333\n", "1.5\n"],
           "input()\nxs = list(map(int, input().split()))\nprint(f'{sum(xs) / len(xs):.9f}')\n",
           "input()\nxs = list(map(int, input().split()))\nprint(sum(xs) // len(xs))\n"),
    _stdin("distinct", "The first line holds n, the second n integers. Print how many distinct values there are.",
           ["5\n1 2 2 3 3\n", "3\n4 4 4\n"], ["3\n", "1\n"],
           "input()\nprint(len(set(input().split())))\n",
           "print(input())\n"),
    _stdin("binary", "Print the binary representation of the non-negative integer n, without leading zeros.",
           ["5\n", "0\n", "1024\n"], ["101\n", "0\n", "10000000000\n"],
           "print(format(int(input()), 'b'))\n",
           "print(bin(int(input())))\n"),
    _stdin("second_largest", "The first line holds n, the second n integers with at least two distinct values. "
           "Print the second largest distinct value.", ["4\n3 1 3 2\n", "2\n5 9\n"], ["2\n", "5\n"],
           "input()\nprint(sorted(set(map(int, input().split())))[-2])\n",
           "input()\nprint(sorted(map(int, input().split()))[-2])\n"),
    _stdin("grid_paths", "Read m and n and print the number of monotone lattice paths from the top-left to the "
           "bottom-right corner of an m x n grid of cells, modulo 1000000007.",
           ["2 2\n", "3 7\n", "1 1\n"], ["2\n", "28\n", "1\n"],
           "m, n = map(int, input().split())\nrow = [1] * n\nfor _ in range(m - 1):\n    for j in range(1, n):\n"
           "        row[j] = (row[j] + row[j - 1]) % 1000000007\nprint(row[-1])\n",
           "m, n = map(int, input().split())\nrow = [1] * (n + 1)\nfor _ in range(m - 1):\n"
           "    for j in range(1, n + 1):\n"
           "        row[j] = (row[j] + row[j - 1]) % 1000000007\nprint(row[-1])\n"),
    _stdin("brackets", "Print YES if the line of ( and ) is balanced, else NO.",
           ["(())\n", ")(\n", "(()\n"], ["YES\n", "NO\n", "NO\n"],
           "depth = 0\nfor ch in input().strip():\n    depth += 1 if ch == '(' else -1\n    if depth < 0:\n"
           "        break\nprint('YES' if depth == 0 else 'NO')\n",
           "s = input().strip()\nprint('YES' if s.count('(') == s.count(')') else 'NO')\n"),
    _call("two_sum", "Write two_sum(nums, target) returning the indices [i, j] (i < j) of the two numbers that add "
          "up to target.", "two_sum", [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]], [[[0, 1]], [[1, 2]]],
          "def two_sum(nums, target):\n    seen = {}\n    for i, x in enumerate(nums):\n"
          "        if target - x in seen:\n            return [seen[target - x], i]\n        seen[x] = i\n",
          "def two_sum(nums, target):\n    for x in nums:\n        if target - x in nums:\n"
          "            return [x, target - x]\n"),
    _call("is_anagram", "Write is_anagram(s, t): True if t is an anagram of s.", "is_anagram",
          [["listen", "silent"], ["aab", "abb"], ["a", "a"]], [True, False, True],
          "def is_anagram(s, t):\n    return sorted(s) == sorted(t)\n",
          "def is_anagram(s, t):\n    return set(s) == set(t)\n"),
    _call("flatten", "Write flatten(nested) returning the integers of an arbitrarily nested list, in order.",
          "flatten", [[[1, [2, [3, 4]], 5]], [[]]], [[1, 2, 3, 4, 5], []],
          "def flatten(nested):\n    out = []\n    for x in nested:\n"
          "        out.extend(flatten(x) if isinstance(x, list) else [x])\n    return out\n",
          "def flatten(nested):\n    out = []\n    for x in nested:\n"
          "        out.extend(x if isinstance(x, list) else [x])\n    return out\n"),
    _call("word_freq", "Write word_freq(text) returning a dict from each lower-cased word to its count.",
          "word_freq", [["a b A"], [""]], [{"a": 2, "b": 1}, {}],
          "from collections import Counter\ndef word_freq(text):\n    return dict(Counter(text.lower().split()))\n",
          "from collections import Counter\ndef word_freq(text):\n    return dict(Counter(text.split()))\n"),
    _call("merge_intervals", "Write merge_intervals(intervals) merging overlapping [start, end] intervals, "
          "sorted by start.", "merge_intervals", [[[[1, 3], [8, 10], [2, 6]]], [[[1, 4], [4, 5]]]],
          [[[1, 6], [8, 10]], [[1, 5]]],
          "def merge_intervals(intervals):\n    out = []\n    for a, b in sorted(intervals):\n"
          "        if out and a <= out[-1][1]:\n            out[-1][1] = max(out[-1][1], b)\n        else:\n"
          "            out.append([a, b])\n    return out\n",
          "def merge_intervals(intervals):\n    out = []\n    for a, b in intervals:\n"
          "        if out and a <= out[-1][1]:\n            out[-1][1] = max(out[-1][1], b)\n        else:\n"
          "            out.append([a, b])\n    return out\n"),
    _call("rotate", "Write rotate(xs, k) returning xs rotated right by k places.", "rotate",
          [[[1, 2, 3, 4, 5], 2], [[1], 3], [[], 1]], [[4, 5, 1, 2, 3], [1], []],
          "def rotate(xs, k):\n    if not xs:\n        return []\n    k %= len(xs)\n    return xs[-k:] + xs[:-k]\n",
          "def rotate(xs, k):\n    if not xs:\n        return []\n    k %= len(xs)\n    return xs[k:] + xs[:k]\n"),
    _functional("max_profit", "LeetCode style: class Solution with maxProfit(self, prices), the best profit of "
                "one buy followed by one sell (0 if none).", "maxProfit",
                [([[7, 1, 5, 3, 6, 4]], 5), ([[7, 6, 4, 3, 1]], 0)],
                "class Solution:\n    def maxProfit(self, prices):\n        best, low = 0, float('inf')\n"
                "        for p in prices:\n            low = min(low, p)\n            best = max(best, p - low)\n"
                "        return best\n",
                "class Solution:\n    def maxProfit(self, prices):\n        return max(prices) - min(prices)\n"),
    _functional("climb_stairs", "LeetCode style: class Solution with climbStairs(self, n), the number of ways to "
                "climb n steps taking 1 or 2 at a time.", "climbStairs", [([2], 2), ([5], 8), ([1], 1)],
                "class Solution:\n    def climbStairs(self, n):\n        a, b = 1, 1\n        for _ in range(n):\n"
                "            a, b = b, a + b\n        return a\n",
                "class Solution:\n    def climbStairs(self, n):\n        a, b = 0, 1\n        for _ in range(n):\n"
                "            a, b = b, a + b\n        return a\n"),
    _asserts("similar_elements", "Write similar_elements(t1, t2) returning the elements two tuples share.",
             "assert set(similar_elements((3, 4, 5, 6), (5, 7, 4, 10))) == set((4, 5))\n"
             "assert set(similar_elements((1, 2, 3, 4), (5, 4, 3, 7))) == set((3, 4))\n",
             "def similar_elements(t1, t2):\n    return tuple(set(t1) & set(t2))\n",
             "def similar_elements(t1, t2):\n    return tuple(set(t1) | set(t2))\n"),
    _asserts("is_not_prime", "Write is_not_prime(n) for n >= 2.",
             "assert is_not_prime(2) == False\nassert is_not_prime(10) == True\nassert is_not_prime(35) == True\n",
             "def is_not_prime(n):\n    return any(n % d == 0 for d in range(2, int(n ** 0.5) + 1))\n",
             "def is_not_prime(n):\n    return n % 2 == 0\n"),
    _asserts("square_perimeter", "Write square_perimeter(a).",
             "assert square_perimeter(10) == 40\nassert square_perimeter(5) == 20\n",
             "def square_perimeter(a):\n    return 4 * a\n",
             "def square_perimeter(a):\n    return a * a if a > 5 else 4 * a\n"),
    _asserts("min_max", "Write min_max(xs) returning the tuple (smallest, largest).",
             "assert min_max([3, 1, 2]) == (1, 3)\nassert min_max([5]) == (5, 5)\n",
             "def min_max(xs):\n    return min(xs), max(xs)\n",
             "def min_max(xs):\n    return [min(xs), max(xs)]\n"),
    _asserts("circle_area", "Write circle_area(r).",
             "import math\nassert math.isclose(circle_area(2), 12.566370614359172, rel_tol=1e-9)\n"
             "assert math.isclose(circle_area(0), 0.0, abs_tol=1e-12)\n",
             "import math\ndef circle_area(r):\n    return math.pi * r * r\n",
             "def circle_area(r):\n    return 3.14 * r * r\n"),
    _asserts("has_close_elements", "HumanEval style: has_close_elements(numbers, threshold) is True if two numbers "
             "are closer than threshold.",
             "def check(candidate):\n    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True\n"
             "    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False\n"
             "    assert candidate([1.0, 2.0, 3.0], 1.0) == False\n",
             "def has_close_elements(numbers, threshold):\n    xs = sorted(numbers)\n"
             "    return any(b - a < threshold for a, b in zip(xs, xs[1:]))\n",
             "def has_close_elements(numbers, threshold):\n    xs = sorted(numbers)\n"
             "    return any(b - a <= threshold for a, b in zip(xs, xs[1:]))\n", entry_point="has_close_elements"),
]


def completion(problem: dict, which: str) -> str:
    """A model-like completion holding the problem's ``correct`` or ``wrong`` solution in a fenced block."""
    return f"Here is my solution.\n```python\n{problem[which]}```\nIt reads the input as described."


def prompt_rows() -> list[dict]:
    rows = []
    for p in PROBLEMS:
        row = {"prompt": p["prompt"], "tests": p["tests"], "fn_name": p.get("fn_name"),
               "entry_point": p.get("entry_point")}
        rows.append(row)
    return rows


def write_prompt_file(path: str | Path) -> Path:
    """The problems as a JSONL prompt file (one object per line) for prepare's ``source: files``."""
    path = Path(path)
    path.write_text("".join(json.dumps(row) + "\n" for row in prompt_rows()))
    return path
