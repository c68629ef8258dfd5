"""Grade-school math word problems made from templates: prompts whose replies teach a drafter and the reply lookup
how the target writes arithmetic, without touching an evaluation set.

GSM8K's training split ships in no package these machines can install, and its test split is an evaluation set, so
neither can be the source. Each template here is a function of a seeded random generator that returns a question
and its answer. The answer is computed, a positive integer, so every problem is well posed (no remainder, no
negative count); the replies are the target's own, right or wrong, because they are what a drafter must predict.

    python -m data.word_problems --n 3000 --out runs/word-problems.jsonl
    python -m train.regenerate --target smollm2 --input runs/word-problems.jsonl --output runs/wp-replies.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = (
    "Aisha Ben Carla Diego Elena Farid Grace Hiro Ines Jamal Kira Liam Maya Noah Olga Pedro Quinn Rosa Sam Tara "
    "Umar Vera Wes Xena Yusuf Zoe Anna Marco Priya Tom Lena Omar Julia Ravi Sofia Kenji Nora Felix Amara Leo"
).split()
FOODS = "apples oranges cookies cupcakes muffins bananas pears lemons peaches bagels donuts tomatoes".split()
THINGS = "pencils stickers marbles books notebooks toy cars crayons postcards stamps beads shells cards".split()
PLACES = "bakery farm shop library school zoo garden cafe market factory".split()
JOBS = ["tutoring", "babysitting", "mowing lawns", "walking dogs", "washing cars", "painting fences"]
CONTAINERS = ("boxes", "bags", "baskets", "crates", "jars", "packs")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")

Problem = tuple[str, int]


def _two_names(r: random.Random) -> tuple[str, str]:
    a, b = r.sample(NAMES, 2)
    return a, b


def rate_time(r: random.Random) -> Problem:
    name, job = r.choice(NAMES), r.choice(JOBS)
    pay, hours, days = r.randint(8, 30), r.randint(2, 8), r.randint(2, 6)
    q = (
        f"{name} earns ${pay} an hour {job}. {name} works {hours} hours a day for {days} days this week. "
        f"How much money does {name} earn this week?"
    )
    return q, pay * hours * days


def buy_and_change(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    n1, n2 = r.randint(2, 6), r.randint(2, 5)
    p1, p2 = r.randint(2, 9), r.randint(3, 12)
    i1, i2 = r.sample(FOODS, 2)
    cost = n1 * p1 + n2 * p2
    paid = (cost // 10 + 1 + r.randint(0, 3)) * 10
    q = (
        f"{name} buys {n1} pounds of {i1} at ${p1} per pound and {n2} pounds of {i2} at ${p2} per pound. "
        f"If {name} pays with ${paid}, how much change does {name} get back?"
    )
    return q, paid - cost


def fraction_given(r: random.Random) -> Problem:
    name, other = _two_names(r)
    d = r.choice((2, 3, 4, 5))
    total = d * r.randint(4, 20)
    kept = r.randint(1, total // d - 1)  # total // d >= 4: some are left
    thing = r.choice(THINGS)
    q = (
        f"{name} has {total} {thing}. {name} gives 1/{d} of them to {other} and then loses {kept} more. "
        f"How many {thing} does {name} have left?"
    )
    return q, total - total // d - kept


def times_as_many(r: random.Random) -> Problem:
    a, b = _two_names(r)
    n, k = r.randint(3, 25), r.randint(2, 5)
    thing = r.choice(THINGS)
    q = f"{a} has {n} {thing}. {b} has {k} times as many {thing} as {a}. How many {thing} do {a} and {b} have together?"
    return q, n + k * n


def ages(r: random.Random) -> Problem:
    a, b = _two_names(r)
    age_b, diff, years = r.randint(4, 15), r.randint(2, 30), r.randint(2, 10)
    q = f"{a} is {diff} years older than {b}. If {b} is {age_b} years old now, how old will {a} be in {years} years?"
    return q, age_b + diff + years


def bakery_sales(r: random.Random) -> Problem:
    place, food = r.choice(PLACES), r.choice(FOODS)
    made, price = r.randint(5, 20) * 10, r.randint(2, 6)
    sold = made - r.randint(1, made // 10) * 5
    q = (
        f"A {place} makes {made} {food} in the morning. By closing time it has sold all but {made - sold} of them, "
        f"at ${price} each. How much money did the {place} make from the {food}?"
    )
    return q, sold * price


def discount(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    price, pct, n = r.randint(2, 20) * 10, r.choice((10, 20, 25, 50)), r.randint(2, 5)
    thing = r.choice(("shirts", "pairs of shoes", "jackets", "games", "lamps", "backpacks"))
    q = (
        f"A store sells {thing} for ${price} each. This week everything is {pct}% off. "
        f"How much does {name} pay for {n} {thing}?"
    )
    return q, n * price * (100 - pct) // 100


def speed_distance(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    s1, t1, s2, t2 = r.randint(30, 70), r.randint(1, 4), r.randint(20, 60), r.randint(1, 3)
    q = (
        f"{name} drives at {s1} miles per hour for {t1} hours, then at {s2} miles per hour for {t2} hours. "
        f"How many miles does {name} drive in total?"
    )
    return q, s1 * t1 + s2 * t2


def share_equally(r: random.Random) -> Problem:
    name, cont = r.choice(NAMES), r.choice(CONTAINERS)
    boxes, per, friends = r.randint(2, 9), r.randint(4, 12), r.choice((2, 3, 4, 6))
    total = boxes * per - boxes * per % friends  # at least 8 - 8 % 6 = 6
    food = r.choice(FOODS)
    q = (
        f"{name} has {total} {food} packed in {cont}. {name} shares them equally among {friends} friends. "
        f"How many {food} does each friend get?"
    )
    return q, total // friends


def savings_weeks(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    weekly, have = r.randint(5, 25), r.randint(0, 60)
    weeks = r.randint(3, 15)
    price = have + weekly * weeks
    thing = r.choice(("bike", "video game", "guitar", "tablet", "skateboard", "telescope"))
    q = (
        f"{name} wants to buy a {thing} that costs ${price}. {name} has already saved ${have} and saves ${weekly} "
        f"every week. How many weeks will it take {name} to save enough money?"
    )
    return q, weeks


def average(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    n = r.randint(3, 5)
    mean = r.randint(60, 95)
    scores = [mean + r.randint(-10, 10) for _ in range(n - 1)]
    last = mean * n - sum(scores)
    if not 0 < last <= 100:
        scores = [mean] * (n - 1)
        last = mean
    q = f"{name} scored {', '.join(map(str, scores))} and {last} on {n} math tests. What is {name}'s average score?"
    return q, mean


def garden_rows(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    rows, per, eaten = r.randint(3, 12), r.randint(4, 15), r.randint(1, 9)
    plant = r.choice(("tomato plants", "carrots", "sunflowers", "rose bushes", "pepper plants", "tulips"))
    q = (
        f"{name} plants {rows} rows of {plant} with {per} in each row. Rabbits eat {eaten} of them. "
        f"How many {plant} are left?"
    )
    return q, rows * per - eaten  # at least 12 - 9


def weekly_pattern(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    weekday, weekend, weeks = r.randint(1, 6), r.randint(2, 10), r.randint(2, 4)
    act = r.choice(("pages", "laps", "push-ups", "miles", "songs"))
    verb = {"pages": "reads", "laps": "swims", "push-ups": "does", "miles": "runs", "songs": "practices"}[act]
    q = (
        f"{name} {verb} {weekday} {act} every weekday and {weekend} {act} on each day of the weekend. "
        f"How many {act} does {name} do in {weeks} weeks?"
    )
    return q, (5 * weekday + 2 * weekend) * weeks


def percent_of(r: random.Random) -> Problem:
    place = r.choice(PLACES)
    total = r.randint(2, 20) * 20
    pct = r.choice((10, 15, 20, 25, 30, 40, 45, 50, 60, 75))
    who = r.choice(("students", "visitors", "workers", "members", "children"))
    q = f"There are {total} {who} at the {place}. {pct}% of them wear glasses. How many {who} do not wear glasses?"
    return q, total - total * pct // 100


def combined_work(r: random.Random) -> Problem:
    a, b = _two_names(r)
    ra, rb, hours = r.randint(3, 12), r.randint(2, 10), r.randint(2, 6)
    thing = r.choice(("boxes", "cakes", "bracelets", "paintings", "bird houses", "scarves"))
    q = (
        f"{a} can make {ra} {thing} an hour and {b} can make {rb} {thing} an hour. "
        f"If they both work for {hours} hours, how many {thing} do they make in all?"
    )
    return q, (ra + rb) * hours


def money_spent_days(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    start = r.randint(10, 40) * 10
    costs = [r.randint(5, 40) for _ in range(3)]
    d = r.sample(DAYS, 3)
    if sum(costs) >= start:
        start = sum(costs) + 20
    q = (
        f"{name} had ${start}. On {d[0]} {name} spent ${costs[0]}, on {d[1]} ${costs[1]}, "
        f"and on {d[2]} ${costs[2]}. How much money does {name} have left?"
    )
    return q, start - sum(costs)


def unit_conversion(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    feet, pieces = r.randint(2, 9), r.choice((2, 3, 4, 6, 8))
    inches = feet * 12
    inches -= inches % pieces
    q = f"{name} has a rope {inches} inches long and cuts it into {pieces} equal pieces. How long is each piece?"
    return q, inches // pieces


def tickets(r: random.Random) -> Problem:
    adults, kids = r.randint(1, 5), r.randint(1, 6)
    pa, pk = r.randint(8, 25), r.randint(3, 12)
    event = r.choice(("movie", "concert", "museum", "circus", "play", "aquarium"))
    q = (
        f"Tickets to the {event} cost ${pa} for adults and ${pk} for children. A family buys {adults} adult "
        f"tickets and {kids} children's tickets. How much do they spend?"
    )
    return q, adults * pa + kids * pk


def pets_legs(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    dogs, birds, spiders = r.randint(1, 6), r.randint(1, 8), r.randint(0, 3)
    q = (
        f"{name} has {dogs} dogs, {birds} chickens and {spiders} pet spiders. "
        f"How many legs do all of {name}'s animals have in total?"
    )
    return q, 4 * dogs + 2 * birds + 8 * spiders


def area_fence(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    w, h, price = r.randint(5, 30), r.randint(5, 30), r.randint(2, 9)
    q = (
        f"{name}'s yard is a rectangle {w} feet wide and {h} feet long. Fencing costs ${price} per foot. "
        f"How much does it cost to fence the whole yard?"
    )
    return q, 2 * (w + h) * price


def remaining_pages(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    per_day, days = r.randint(10, 40), r.randint(2, 7)
    left = r.randint(5, 120)
    total = per_day * days + left
    q = (
        f"{name}'s book has {total} pages. {name} reads {per_day} pages a day for {days} days. "
        f"How many pages does {name} still have to read?"
    )
    return q, left


def double_each_day(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    first, days = r.randint(1, 6), r.randint(3, 6)
    thing = r.choice(("emails", "photos", "shells", "coins", "drawings"))
    q = (
        f"{name} collected {first} {thing} on the first day and each day after collected twice as many as the day "
        f"before. How many {thing} did {name} collect in {days} days?"
    )
    return q, first * (2**days - 1)


def profit(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    n, cost, price = r.randint(10, 60), r.randint(1, 6), 0
    price = cost + r.randint(1, 5)
    thing = r.choice(("lemonade cups", "bracelets", "candles", "cookies", "posters"))
    q = (
        f"{name} makes {n} {thing}. Each one costs ${cost} to make and {name} sells all of them for ${price} each. "
        f"How much profit does {name} make?"
    )
    return q, n * (price - cost)


def groups_seats(r: random.Random) -> Problem:
    people, per = r.randint(20, 120), r.choice((4, 5, 6, 8, 10))
    vehicle = r.choice(("vans", "cars", "tables", "boats", "tents"))
    q = (
        f"{people} people are going on a trip. Each of the {vehicle} holds {per} people. "
        f"How many {vehicle} are needed so that everyone has a place?"
    )
    return q, -(-people // per)


TEMPLATES: tuple[Callable[[random.Random], Problem], ...] = (
    rate_time,
    buy_and_change,
    fraction_given,
    times_as_many,
    ages,
    bakery_sales,
    discount,
    speed_distance,
    share_equally,
    savings_weeks,
    average,
    garden_rows,
    weekly_pattern,
    percent_of,
    combined_work,
    money_spent_days,
    unit_conversion,
    tickets,
    pets_legs,
    area_fence,
    remaining_pages,
    double_each_day,
    profit,
    groups_seats,
)


def word_problems(n: int, seed: int = 0) -> list[dict]:
    """n distinct problems as conversations {id, messages: [user], answer}, the templates taken in turn."""
    r = random.Random(seed)
    rows, seen = [], set()
    i = 0
    while len(rows) < n:
        template = TEMPLATES[i % len(TEMPLATES)]
        i += 1
        if i > 50 * n + 1000:
            raise ValueError(f"word_problems: only {len(rows)} distinct problems in {i} draws for n={n}")
        q, answer = template(r)
        if q in seen:
            continue
        seen.add(q)
        rows.append(
            {
                "id": f"wp/{seed}/{len(rows)}/{template.__name__}",
                "messages": [{"role": "user", "content": q}],
                "answer": answer,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, required=True, help="how many problems")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="JSONL to write, one conversation per line")
    args = ap.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for row in word_problems(args.n, args.seed):
            f.write(json.dumps(row) + "\n")
    print(f"wrote {args.n} problems ({len(TEMPLATES)} templates) to {args.out}")
    return 0


if __name__ == "__main__":
    from dflash_model.cli import run_main

    raise SystemExit(run_main(main))
