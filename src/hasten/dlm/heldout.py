'''Held-out prompts for ``hasten dlm bench --heldout``: three small Python modules written for this check on
2026-11-26, before any measurement with them, and never used to tune a hasten.dlm setting (the bench's other
prompts come from the zoo corpus's held-out stdlib files, on which ``fresh_before_block`` was chosen).
The task is the bench's usual one (``tasks.completion_tasks``): complete one of their functions.
'''
from __future__ import annotations

LEDGER = '''"""A small double-entry ledger: accounts, postings and balances kept in integer cents."""

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import date


class LedgerError(Exception):
    """Raised when a transaction does not balance or names an unknown account."""


@dataclass(frozen=True)
class Posting:
    """One line of a transaction: an account and a signed amount in cents."""

    account: str
    cents: int
    memo: str = ""


@dataclass
class Transaction:
    """A dated set of postings whose amounts sum to zero."""

    when: date
    description: str
    postings: list = field(default_factory=list)

    def add(self, account, cents, memo=""):
        """Append a posting and return the transaction, so calls can be chained."""
        self.postings.append(Posting(account, int(cents), memo))
        return self

    def total(self):
        """The sum of every posting's amount; zero for a balanced transaction."""
        return sum(posting.cents for posting in self.postings)

    def accounts(self):
        """The accounts this transaction touches, in the order they first appear."""
        seen = []
        for posting in self.postings:
            if posting.account not in seen:
                seen.append(posting.account)
        return seen


class Ledger:
    """Accounts by name and the transactions posted to them, in posting order."""

    KINDS = ("asset", "liability", "income", "expense", "equity")

    def __init__(self, currency="EUR"):
        self.currency = currency
        self.kinds = {}
        self.transactions = []

    def open(self, name, kind):
        """Open an account of one of the known kinds; opening it twice is an error."""
        if kind not in self.KINDS:
            raise LedgerError(f"unknown account kind {kind!r}")
        if name in self.kinds:
            raise LedgerError(f"account {name!r} is already open")
        self.kinds[name] = kind

    def post(self, transaction):
        """Check a transaction and keep it; the ledger never holds an unbalanced one."""
        if transaction.total() != 0:
            raise LedgerError(f"{transaction.description!r} is off by {transaction.total()} cents")
        for name in transaction.accounts():
            if name not in self.kinds:
                raise LedgerError(f"unknown account {name!r}")
        self.transactions.append(transaction)
        return transaction

    def balances(self, until=None):
        """Every account's balance in cents, counting transactions up to ``until`` (all when None)."""
        totals = defaultdict(int)
        for transaction in self.transactions:
            if until is not None and transaction.when > until:
                continue
            for posting in transaction.postings:
                totals[posting.account] += posting.cents
        return dict(totals)

    def balance(self, name, until=None):
        """One account's balance in cents."""
        if name not in self.kinds:
            raise LedgerError(f"unknown account {name!r}")
        return self.balances(until).get(name, 0)

    def history(self, name):
        """The postings of one account with the running balance after each, oldest first."""
        running = 0
        rows = []
        for transaction in self.transactions:
            for posting in transaction.postings:
                if posting.account == name:
                    running += posting.cents
                    rows.append((transaction.when, transaction.description, posting.cents, running))
        return rows

    def by_kind(self, kind):
        """The names of the open accounts of one kind, sorted."""
        return sorted(name for name, other in self.kinds.items() if other == kind)

    def net_worth(self, until=None):
        """Assets minus liabilities, in cents."""
        balances = self.balances(until)
        assets = sum(balances.get(name, 0) for name in self.by_kind("asset"))
        liabilities = sum(balances.get(name, 0) for name in self.by_kind("liability"))
        return assets + liabilities

    def income_statement(self, start, end):
        """Income and expenses between two dates, inclusive, as a dict of account to cents."""
        totals = defaultdict(int)
        for transaction in self.transactions:
            if not start <= transaction.when <= end:
                continue
            for posting in transaction.postings:
                if self.kinds[posting.account] in ("income", "expense"):
                    totals[posting.account] += posting.cents
        return dict(totals)

    def largest(self, count=5):
        """The transactions moving the most money, largest first."""
        def moved(transaction):
            return sum(posting.cents for posting in transaction.postings if posting.cents > 0)
        return sorted(self.transactions, key=moved, reverse=True)[:count]

    def close(self, name):
        """Close an account whose balance is zero."""
        if self.balance(name) != 0:
            raise LedgerError(f"account {name!r} still holds {self.balance(name)} cents")
        del self.kinds[name]

    def months(self):
        """The first day of every month that has a transaction, sorted."""
        firsts = {transaction.when.replace(day=1) for transaction in self.transactions}
        return sorted(firsts)

    def monthly_totals(self, name):
        """One account's movement per month, as a list of (first day, cents)."""
        totals = defaultdict(int)
        for transaction in self.transactions:
            for posting in transaction.postings:
                if posting.account == name:
                    totals[transaction.when.replace(day=1)] += posting.cents
        return sorted(totals.items())


def format_cents(cents, currency="EUR"):
    """Render an amount such as -1234 as '-12.34 EUR'."""
    sign = "-" if cents < 0 else ""
    whole, part = divmod(abs(cents), 100)
    return f"{sign}{whole}.{part:02d} {currency}"


def parse_amount(text):
    """Read '12.34', '-5' or '0.5' as integer cents; anything else is an error."""
    text = text.strip()
    negative = text.startswith("-")
    if negative:
        text = text[1:]
    whole, _, part = text.partition(".")
    if not whole.isdigit() or (part and not part.isdigit()) or len(part) > 2:
        raise LedgerError(f"not an amount: {text!r}")
    cents = int(whole) * 100 + int(part.ljust(2, "0") or 0)
    return -cents if negative else cents


def split_evenly(cents, parts):
    """Split an amount into ``parts`` amounts that differ by at most one cent and sum to it."""
    base, extra = divmod(cents, parts)
    return [base + 1 if index < extra else base for index in range(parts)]


def transfer(ledger, when, source, target, cents, description="transfer"):
    """Post a transaction moving ``cents`` from one account to another."""
    transaction = Transaction(when, description)
    transaction.add(source, -cents).add(target, cents)
    return ledger.post(transaction)


def report(ledger, until=None):
    """One line per account, kinds in order, with its balance formatted."""
    lines = []
    balances = ledger.balances(until)
    for kind in ledger.KINDS:
        for name in ledger.by_kind(kind):
            amount = format_cents(balances.get(name, 0), ledger.currency)
            lines.append(f"{kind:<10} {name:<24} {amount:>16}")
    return "\\n".join(lines)
'''

GRID = '''"""Grids of characters: parsing, neighbours, flood fill and shortest paths on a maze."""

import heapq
from collections import deque

WALL = "#"
OPEN = "."
DIRECTIONS = {"N": (-1, 0), "S": (1, 0), "W": (0, -1), "E": (0, 1)}


class Grid:
    """A rectangle of single-character cells addressed by (row, column)."""

    def __init__(self, rows):
        widths = {len(row) for row in rows}
        if len(widths) > 1:
            raise ValueError("every row of a grid must have the same width")
        self.rows = [list(row) for row in rows]
        self.height = len(rows)
        self.width = widths.pop() if widths else 0

    @classmethod
    def parse(cls, text):
        """Build a grid from text, one row per non-empty line."""
        return cls([line for line in text.splitlines() if line.strip()])

    def __getitem__(self, cell):
        row, column = cell
        return self.rows[row][column]

    def __setitem__(self, cell, value):
        row, column = cell
        self.rows[row][column] = value

    def inside(self, cell):
        """Whether a cell lies within the grid."""
        row, column = cell
        return 0 <= row < self.height and 0 <= column < self.width

    def cells(self):
        """Every cell, row by row."""
        for row in range(self.height):
            for column in range(self.width):
                yield row, column

    def find(self, value):
        """The first cell holding ``value``, or None."""
        for cell in self.cells():
            if self[cell] == value:
                return cell
        return None

    def neighbours(self, cell, diagonal=False):
        """The cells next to ``cell`` inside the grid, the four sides first."""
        row, column = cell
        steps = list(DIRECTIONS.values())
        if diagonal:
            steps += [(-1, -1), (-1, 1), (1, -1), (1, 1)]
        for d_row, d_column in steps:
            other = (row + d_row, column + d_column)
            if self.inside(other):
                yield other

    def count(self, value):
        """How many cells hold ``value``."""
        return sum(1 for cell in self.cells() if self[cell] == value)

    def render(self):
        """The grid as text, one line per row."""
        return "\\n".join("".join(row) for row in self.rows)

    def transpose(self):
        """A new grid with rows and columns swapped."""
        return Grid(["".join(self.rows[row][column] for row in range(self.height)) for column in range(self.width)])

    def rotate(self):
        """A new grid turned a quarter clockwise."""
        return Grid(["".join(self.rows[row][column] for row in reversed(range(self.height)))
                     for column in range(self.width)])


def flood_fill(grid, start, value):
    """Paint the region of cells equal to the start cell with ``value``; return how many changed."""
    target = grid[start]
    if target == value:
        return 0
    queue = deque([start])
    grid[start] = value
    changed = 1
    while queue:
        cell = queue.popleft()
        for other in grid.neighbours(cell):
            if grid[other] == target:
                grid[other] = value
                changed += 1
                queue.append(other)
    return changed


def regions(grid, value=OPEN):
    """The connected regions of cells holding ``value``, each a set of cells."""
    seen = set()
    found = []
    for cell in grid.cells():
        if grid[cell] != value or cell in seen:
            continue
        region = {cell}
        queue = deque([cell])
        while queue:
            current = queue.popleft()
            for other in grid.neighbours(current):
                if grid[other] == value and other not in region:
                    region.add(other)
                    queue.append(other)
        seen |= region
        found.append(region)
    return found


def shortest_path(grid, start, goal):
    """The fewest steps from start to goal through open cells, or None when the goal cannot be reached."""
    distance = {start: 0}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            return distance[cell]
        for other in grid.neighbours(cell):
            if grid[other] != WALL and other not in distance:
                distance[other] = distance[cell] + 1
                queue.append(other)
    return None


def cheapest_path(grid, start, goal, cost):
    """The least total cost from start to goal, where ``cost`` maps a cell's character to the price of entering it."""
    best = {start: 0}
    heap = [(0, start)]
    while heap:
        spent, cell = heapq.heappop(heap)
        if cell == goal:
            return spent
        if spent > best.get(cell, spent):
            continue
        for other in grid.neighbours(cell):
            price = cost.get(grid[other])
            if price is None:
                continue
            total = spent + price
            if total < best.get(other, total + 1):
                best[other] = total
                heapq.heappush(heap, (total, other))
    return None


def walk(grid, start, moves):
    """Follow a string of N/S/W/E moves from start, stopping at walls; return the final cell."""
    row, column = start
    for move in moves:
        d_row, d_column = DIRECTIONS[move]
        other = (row + d_row, column + d_column)
        if grid.inside(other) and grid[other] != WALL:
            row, column = other
    return row, column


def dead_ends(grid):
    """Open cells with exactly one open neighbour."""
    ends = []
    for cell in grid.cells():
        if grid[cell] == WALL:
            continue
        open_sides = [other for other in grid.neighbours(cell) if grid[other] != WALL]
        if len(open_sides) == 1:
            ends.append(cell)
    return ends


def border(grid):
    """The cells on the grid's edge, clockwise from the top left."""
    top = [(0, column) for column in range(grid.width)]
    right = [(row, grid.width - 1) for row in range(1, grid.height)]
    bottom = [(grid.height - 1, column) for column in reversed(range(grid.width - 1))]
    left = [(row, 0) for row in reversed(range(1, grid.height - 1))]
    return top + right + bottom + left


def life_step(grid, alive="#", dead="."):
    """One step of Conway's game of life on the grid, returning a new grid."""
    rows = []
    for row in range(grid.height):
        line = []
        for column in range(grid.width):
            around = sum(1 for other in grid.neighbours((row, column), diagonal=True) if grid[other] == alive)
            here = grid[row, column] == alive
            line.append(alive if around == 3 or (here and around == 2) else dead)
        rows.append("".join(line))
    return Grid(rows)
'''

SETTINGS = '''"""Reading and checking settings files: sections, typed values, defaults and environment overrides."""

import os
import re

SECTION = re.compile(r"^\\[(?P<name>[A-Za-z0-9_.-]+)\\]$")
ASSIGNMENT = re.compile(r"^(?P<key>[A-Za-z0-9_.-]+)\\s*=\\s*(?P<value>.*)$")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class SettingsError(ValueError):
    """A settings file that cannot be read, with the line it failed on."""

    def __init__(self, message, line_number=None):
        if line_number is not None:
            message = f"line {line_number}: {message}"
        super().__init__(message)
        self.line_number = line_number


def strip_comment(line):
    """The line without a trailing comment; a '#' inside quotes is kept."""
    quoted = None
    for index, char in enumerate(line):
        if char in "\\"'" and quoted in (None, char):
            quoted = None if quoted else char
        elif char == "#" and quoted is None:
            return line[:index].rstrip()
    return line.rstrip()


def unquote(value):
    """Remove one pair of matching quotes around a value."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\\"'":
        return value[1:-1]
    return value


def parse(text):
    """Read settings text into a dict of section name to a dict of key to raw string."""
    sections = {"": {}}
    current = sections[""]
    for number, raw in enumerate(text.splitlines(), start=1):
        line = strip_comment(raw).strip()
        if not line:
            continue
        header = SECTION.match(line)
        if header:
            current = sections.setdefault(header.group("name"), {})
            continue
        assignment = ASSIGNMENT.match(line)
        if not assignment:
            raise SettingsError(f"cannot read {raw!r}", number)
        current[assignment.group("key")] = unquote(assignment.group("value").strip())
    return sections


def to_bool(value):
    """Read a yes/no word as a bool."""
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise SettingsError(f"expected yes or no, got {value!r}")


def to_list(value, separator=","):
    """Split a value into its stripped, non-empty parts."""
    return [part.strip() for part in value.split(separator) if part.strip()]


def to_size(value):
    """Read sizes such as '512', '4k', '2M' or '1G' as a number of bytes."""
    match = re.fullmatch(r"\\s*(\\d+)\\s*([kKmMgG]?)\\s*", value)
    if not match:
        raise SettingsError(f"not a size: {value!r}")
    number, unit = int(match.group(1)), match.group(2).lower()
    return number * {"": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}[unit]


def to_duration(value):
    """Read durations such as '30s', '5m' or '2h' as seconds."""
    match = re.fullmatch(r"\\s*(\\d+)\\s*([smh])\\s*", value)
    if not match:
        raise SettingsError(f"not a duration: {value!r}")
    return int(match.group(1)) * {"s": 1, "m": 60, "h": 3600}[match.group(2)]


class Field:
    """One expected key: its converter, default and whether it must be given."""

    def __init__(self, convert=str, default=None, required=False, help=""):
        self.convert = convert
        self.default = default
        self.required = required
        self.help = help

    def read(self, raw, name):
        """Convert a raw string, naming the key in any error."""
        try:
            return self.convert(raw)
        except (SettingsError, ValueError) as error:
            raise SettingsError(f"{name}: {error}") from None


class Schema:
    """The fields expected in each section."""

    def __init__(self, sections):
        self.sections = sections

    def keys(self):
        """Every (section, key) the schema knows, sorted."""
        return sorted((section, key) for section, fields in self.sections.items() for key in fields)

    def defaults(self):
        """The default of every field, as nested dicts."""
        return {section: {key: field.default for key, field in fields.items()}
                for section, fields in self.sections.items()}

    def check(self, parsed):
        """Convert a parsed file with this schema, filling defaults; unknown keys are errors."""
        result = self.defaults()
        for section, values in parsed.items():
            if not values:
                continue
            if section not in self.sections:
                raise SettingsError(f"unknown section {section!r}")
            for key, raw in values.items():
                field = self.sections[section].get(key)
                if field is None:
                    raise SettingsError(f"unknown key {section}.{key}")
                result[section][key] = field.read(raw, f"{section}.{key}")
        self.require(result)
        return result

    def require(self, result):
        """Raise if a required field was left without a value."""
        missing = [f"{section}.{key}" for section, fields in self.sections.items()
                   for key, field in fields.items() if field.required and result[section][key] is None]
        if missing:
            raise SettingsError("missing " + ", ".join(missing))

    def overrides(self, environ=None, prefix="APP_"):
        """Values from environment variables named PREFIX_SECTION_KEY, converted, as nested dicts."""
        environ = os.environ if environ is None else environ
        found = {}
        for section, fields in self.sections.items():
            for key, field in fields.items():
                name = f"{prefix}{section}_{key}".upper().replace(".", "_").replace("-", "_")
                if name in environ:
                    found.setdefault(section, {})[key] = field.read(environ[name], name)
        return found

    def load(self, text, environ=None, prefix="APP_"):
        """Parse, check and apply environment overrides, in that order."""
        result = self.check(parse(text))
        for section, values in self.overrides(environ, prefix).items():
            result[section].update(values)
        return result

    def describe(self):
        """One line per field: section.key, default and help."""
        lines = []
        for section, key in self.keys():
            field = self.sections[section][key]
            lines.append(f"{section}.{key} (default {field.default!r}): {field.help}")
        return "\\n".join(lines)


def merge(base, extra):
    """A copy of ``base`` with the sections and keys of ``extra`` laid over it."""
    merged = {section: dict(values) for section, values in base.items()}
    for section, values in extra.items():
        merged.setdefault(section, {}).update(values)
    return merged


def render(settings):
    """Write nested dicts back as settings text, sections sorted, keys in order."""
    lines = []
    for section in sorted(settings):
        if section:
            lines.append(f"[{section}]")
        for key, value in settings[section].items():
            if isinstance(value, bool):
                value = "yes" if value else "no"
            lines.append(f"{key} = {value}")
        lines.append("")
    return "\\n".join(lines)


def diff(old, new):
    """The (section, key, old value, new value) of every key whose value changed, was added or removed."""
    changes = []
    for section in sorted(set(old) | set(new)):
        before, after = old.get(section, {}), new.get(section, {})
        for key in sorted(set(before) | set(after)):
            if before.get(key) != after.get(key):
                changes.append((section, key, before.get(key), after.get(key)))
    return changes
'''

SOURCES = {"ledger.py": LEDGER, "grid.py": GRID, "settings.py": SETTINGS}
