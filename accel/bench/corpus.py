"""Seeded text generators: haystack filler sentences and synthetic reports.

Everything is assembled from the small word lists below with a ``random.Random`` seeded by
the caller, so a seed always gives the same text and nothing is downloaded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["filler_sentence", "filler_sentences", "Report", "make_report", "PEOPLE_FIRST", "PEOPLE_LAST"]

_ADJ = (
    "quiet", "old", "bright", "narrow", "distant", "small", "heavy", "green", "busy", "cold",
    "warm", "tall", "wooden", "gentle", "rusty", "shallow", "crowded", "patient", "curious", "plain",
)
_NOUN = (
    "river", "farmer", "market", "bridge", "village", "teacher", "garden", "train", "lighthouse",
    "baker", "library", "mountain", "harbour", "fox", "orchard", "clock", "painter", "meadow",
    "tower", "sailor", "kitchen", "forest", "school", "road", "window",
)
_VERB = (
    "watches", "crosses", "follows", "passes", "visits", "faces", "circles", "remembers", "reaches",
    "leaves", "finds", "guards", "paints", "counts", "greets",
)
_PLACE = (
    "the hill", "the square", "the old mill", "the station", "the shore", "the valley", "the gate",
    "the fields", "the town hall", "the quiet lane", "the pier", "the chapel",
)
_TIME = (
    "every morning", "before noon", "in the evening", "after the rain", "at dawn", "in winter",
    "on market days", "at dusk", "in early spring", "late at night",
)
_CLAUSE = (
    "and nobody seems to mind", "while the wind turns slowly", "as it has done for years",
    "and the light changes on the water", "before the bells ring", "while birds gather on the roofs",
    "and the smell of bread drifts past", "as the clouds move east",
)


def filler_sentence(rng: random.Random) -> str:
    """One plain, harmless sentence, e.g. "The rusty bridge faces the pier at dusk."."""
    s = f"The {rng.choice(_ADJ)} {rng.choice(_NOUN)} {rng.choice(_VERB)} {rng.choice(_PLACE)} {rng.choice(_TIME)}"
    if rng.random() < 0.4:
        s += f" {rng.choice(_CLAUSE)}"
    return s + "."


def filler_sentences(rng: random.Random, n: int) -> list[str]:
    return [filler_sentence(rng) for _ in range(n)]


# --------------------------------------------------------------------------- reports

PEOPLE_FIRST = (
    "Alice", "Bruno", "Chiara", "Daniel", "Elena", "Farid", "Grace", "Hiroshi", "Ingrid", "Jonas",
    "Kamala", "Lucas", "Marta", "Nikolai", "Olivia", "Pedro", "Rosa", "Samuel", "Tamsin", "Viktor",
)
PEOPLE_LAST = (
    "Adler", "Brennan", "Castillo", "Dubois", "Eriksen", "Fontaine", "Gallagher", "Hartmann",
    "Iwasaki", "Jovanovic", "Kowalski", "Lindqvist", "Moreau", "Novak", "Okafor", "Petrov",
    "Quintero", "Rasmussen", "Silva", "Thornton",
)
_ROLES = ("operations lead", "chief engineer", "finance director", "site manager", "head of research",
          "logistics coordinator", "quality officer", "sales manager")
_ORGS = ("Northwind Ferries", "Blue Pine Cooperative", "Harbourline Energy", "Oakfield Mills",
         "Silverbrook Transit", "Redstone Foundry", "Meadowgate Farms", "Clearwater Labs")
_TOPICS = ("Fleet maintenance", "Regional sales", "Energy use", "Staff training", "Supply chain",
           "Customer service", "Safety record", "Research projects", "Facilities", "Water quality",
           "Warehouse capacity", "Community outreach", "Procurement", "Software systems",
           "Weather disruptions", "Budget planning")
_METRICS = ("the number of completed inspections", "monthly revenue in thousands of euros",
            "the count of delivered orders", "average response time in minutes",
            "the number of trained staff", "fuel use in thousands of litres",
            "the backlog of open tickets", "the number of new customers")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
           "October", "November", "December")
_ITEMS = ("replace the pumps at the north dock", "renew the delivery contracts", "hire two technicians",
          "move the archive to the new building", "test the backup generators", "repaint the loading bay",
          "update the booking software", "audit the spare parts store", "plant trees along the east road",
          "survey the customers in the harbour district")


@dataclass(frozen=True)
class Report:
    """A generated report: a title line and named sections (title, body text).

    people: the full names that appear in the body texts (what ``extract`` asks for).
    """

    title: str
    sections: tuple[tuple[str, str], ...]
    people: tuple[str, ...]

    def text(self, n_sections: int | None = None) -> str:
        parts = [self.title, ""]
        for title, body in self.sections[: n_sections if n_sections is not None else len(self.sections)]:
            parts += [f"## {title}", body, ""]
        return "\n".join(parts).strip()

    def people_in(self, n_sections: int) -> tuple[str, ...]:
        body = " ".join(b for _, b in self.sections[:n_sections])
        return tuple(p for p in self.people if p in body)


def _section_body(rng: random.Random, people: list[tuple[str, str]], start: int) -> str:
    lines = []
    for k in range(rng.randint(3, 5)):
        name, role = people[(start + k) % len(people)]
        month, metric = rng.choice(_MONTHS), rng.choice(_METRICS)
        value = rng.randint(12, 9800)
        lines.append(rng.choice((
            f"{name}, the {role}, reported that {metric} reached {value} in {month}.",
            f"In {month}, {metric} was {value}, according to {name} ({role}).",
            f"{name} noted that {metric} changed by {rng.randint(2, 40)} percent, to {value}, by the end of {month}.",
        )))
    body = " ".join(lines)
    if rng.random() < 0.5:
        items = rng.sample(_ITEMS, 3)
        body += "\nPlanned actions:\n" + "\n".join(f"- {i.capitalize()}." for i in items)
    return body


def make_report(rng: random.Random, n_sections: int, n_people: int = 4) -> Report:
    """A report of ``n_sections`` sections; the people rotate through the sentences, so every
    one of them appears within the first two sections."""
    org = rng.choice(_ORGS)
    firsts = rng.sample(PEOPLE_FIRST, n_people)
    lasts = rng.sample(PEOPLE_LAST, n_people)
    people = [(f"{f} {l}", rng.choice(_ROLES)) for f, l in zip(firsts, lasts)]
    topics = list(_TOPICS)
    rng.shuffle(topics)
    sections = []
    start = 0
    for i in range(n_sections):
        topic = topics[i % len(topics)] + ("" if i < len(topics) else f" (part {i // len(topics) + 1})")
        body = _section_body(rng, people, start)
        start += 5
        sections.append((f"Section {i + 1}: {topic}", body))
    return Report(title=f"{org}: annual operations report", sections=tuple(sections),
                  people=tuple(p for p, _ in people))
