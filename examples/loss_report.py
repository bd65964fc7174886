"""Shared by the examples: per-step losses of the single-device and tfpar runs side by side."""


def report(plain, parallel, label="tfpar", tolerance=1e-4) -> int:
    """Print the table and the verdict; returns the exit code (0 if equivalent)."""
    print(f"\n{'step':>4}  {'1 device':>10}  {label:>10}  {'|diff|':>9}")
    for i, (a, b) in enumerate(zip(plain, parallel)):
        print(f"{i:>4}  {a:>10.6f}  {b:>10.6f}  {abs(a - b):>9.2e}")
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(plain, parallel))
    print(f"\nlargest relative difference: {worst:.2e} "
          f"({'equivalent' if worst < tolerance else 'NOT equivalent'})")
    return 0 if worst < tolerance else 1
