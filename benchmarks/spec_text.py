"""Real-text prompts for speculative decoding: chat requests whose answers copy from the
prompt (repeat, edit, document, summarize a code snippet), the workload where prompt-lookup
(n-gram) drafting pays off. Fixed data, so runs compare across machines and commits."""

from __future__ import annotations

SNIPPETS = [
    '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals."""
    intervals = sorted(intervals, key=lambda iv: iv[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged''',
    """class LRUCache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}

    def get(self, key):
        if key not in self.items:
            return None
        value = self.items.pop(key)
        self.items[key] = value
        return value

    def put(self, key, value):
        self.items.pop(key, None)
        self.items[key] = value
        if len(self.items) > self.capacity:
            oldest = next(iter(self.items))
            del self.items[oldest]""",
    """def word_counts(path):
    counts = {}
    with open(path) as f:
        for line in f:
            for word in line.lower().split():
                word = word.strip(".,;:!?\\"'()")
                if word:
                    counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])""",
    """def binary_search(items, target):
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1""",
    """function debounce(fn, wait) {
  let timer = null;
  return function (...args) {
    clearTimeout(timer);
    timer = setTimeout(() => fn.apply(this, args), wait);
  };
}""",
    """def parse_config(text):
    config = {}
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            config[section] = {}
        elif "=" in line and section is not None:
            key, value = line.split("=", 1)
            config[section][key.strip()] = value.strip()
    return config""",
    """SELECT customers.name, COUNT(orders.id) AS order_count, SUM(orders.total) AS revenue
FROM customers
JOIN orders ON orders.customer_id = customers.id
WHERE orders.created_at >= '2024-01-01'
GROUP BY customers.name
HAVING COUNT(orders.id) > 3
ORDER BY revenue DESC
LIMIT 10;""",
    """fn fibonacci(n: u64) -> u64 {
    let mut a = 0;
    let mut b = 1;
    for _ in 0..n {
        let next = a + b;
        a = b;
        b = next;
    }
    a
}""",
]

TASKS = [
    "Repeat the following code exactly, without any change:\n\n{code}",
    "Rename every variable in this code to a more descriptive name and show the full result:\n\n{code}",
    "Add a comment above each line of this code explaining it, and show the whole code:\n\n{code}",
    "Summarize what this code does, quoting the important lines:\n\n{code}",
]


def conversations(n: int) -> list[list[dict]]:
    """``n`` single-turn chats over every (snippet, task) pair, consecutive ones differing in
    both (stride 5, coprime with the 32 pairs)."""
    pairs = [(t, s) for s in SNIPPETS for t in TASKS]
    out = []
    for i in range(n):
        task, code = pairs[(5 * i) % len(pairs)]
        out.append([{"role": "user", "content": task.format(code=code)}])
    return out
