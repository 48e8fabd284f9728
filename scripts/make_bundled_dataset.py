#!/usr/bin/env python3
"""Generate phalanx's bundled demo dataset: health-assistant chats with function calling.

Deterministic (seeded `random`, standard library only, no network): running it twice writes the
same bytes. Each line of the output is one conversation in OpenAI chat format,
{"messages": [...], "tools": [...]}, where assistant turns call tools, `tool` messages answer them
with JSON computed from the arguments (a BMI is the actual BMI), and a final assistant turn uses
the results. Conversations are kept short because the embedded model reads bytes.

    python scripts/make_bundled_dataset.py                 # writes src/phalanx/data/bundled/health_agent.jsonl
    python scripts/make_bundled_dataset.py --out x.jsonl --stats   # stats need transformers + phalanx
"""

from __future__ import annotations

import argparse
import json
import random
import string
from datetime import date, timedelta
from pathlib import Path

SEED = 20250314
ROWS = 300
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src" / "phalanx" / "data" / "bundled" / "health_agent.jsonl"


def dumps(obj) -> str:
    # Same spelling as the chat template's `tojson`, so string and dict arguments render alike.
    return json.dumps(obj, ensure_ascii=False)


# --------------------------------------------------------------------------------------------
# Tools: compact JSON-schema specs (every byte is a token for the embedded model).


def _spec(name, description, properties, required):
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


NUM, INT, STR = {"type": "number"}, {"type": "integer"}, {"type": "string"}

TOOLS = {
    t["function"]["name"]: t
    for t in [
        _spec("lookup_medication", "Facts and adult dosing for a drug.", {"name": STR}, ["name"]),
        _spec(
            "check_drug_interaction",
            "Interaction between two drugs.",
            {"drug_a": STR, "drug_b": STR},
            ["drug_a", "drug_b"],
        ),
        _spec("find_nearby_clinic", "Clinics in a city.", {"city": STR, "specialty": STR}, ["city"]),
        _spec(
            "schedule_appointment",
            "Book a clinic visit.",
            {"clinic": STR, "date": STR, "time": STR, "reason": STR},
            ["clinic", "date", "time"],
        ),
        _spec(
            "log_symptom",
            "Add a symptom to the diary.",
            {"symptom": STR, "severity": INT, "notes": STR},
            ["symptom", "severity"],
        ),
        _spec("get_bmi", "Body-mass index.", {"weight_kg": NUM, "height_cm": NUM}, ["weight_kg", "height_cm"]),
        _spec(
            "get_vaccination_schedule",
            "Vaccines due at an age.",
            {"age": NUM, "unit": {"type": "string", "enum": ["months", "years"]}},
            ["age", "unit"],
        ),
        _spec(
            "convert_units",
            "Convert lb/kg, in/cm, F/C, mg/dL/mmol/L.",
            {"value": NUM, "from_unit": STR, "to_unit": STR},
            ["value", "from_unit", "to_unit"],
        ),
        _spec("daily_water_intake", "Daily water target.", {"weight_kg": NUM, "exercise_min": INT}, ["weight_kg"]),
        _spec(
            "daily_calories",
            "Calorie needs (Mifflin-St Jeor).",
            {
                "sex": {"type": "string", "enum": ["female", "male"]},
                "age": INT,
                "weight_kg": NUM,
                "height_cm": NUM,
                "activity": {"type": "string", "enum": ["low", "moderate", "high"]},
            },
            ["sex", "age", "weight_kg", "height_cm", "activity"],
        ),
    ]
}

# --------------------------------------------------------------------------------------------
# Facts the tools answer from. Plausible adult label values for a demo, not medical advice.

MEDS = {
    "ibuprofen": ("NSAID", "pain, fever and inflammation", "200-400 mg every 4-6 h", 1200, False),
    "acetaminophen": ("analgesic", "pain and fever", "500-1000 mg every 4-6 h", 3000, False),
    "naproxen": ("NSAID", "pain and inflammation", "220 mg every 8-12 h", 660, False),
    "aspirin": ("NSAID", "pain and fever", "325-650 mg every 4 h", 4000, False),
    "loratadine": ("antihistamine", "allergies and hay fever", "10 mg once daily", 10, False),
    "cetirizine": ("antihistamine", "allergies and hives", "10 mg once daily", 10, False),
    "omeprazole": ("proton pump inhibitor", "heartburn and reflux", "20 mg once daily", 20, False),
    "metformin": ("biguanide", "type 2 diabetes", "500 mg twice daily with meals", 2000, True),
    "lisinopril": ("ACE inhibitor", "high blood pressure", "10 mg once daily", 80, True),
    "atorvastatin": ("statin", "high cholesterol", "10-20 mg once daily", 80, True),
    "sertraline": ("SSRI", "depression and anxiety", "50 mg once daily", 200, True),
    "amoxicillin": ("penicillin antibiotic", "bacterial infections", "500 mg every 8 h", 1500, True),
    "warfarin": ("anticoagulant", "preventing clots", "set by INR tests", None, True),
    "diphenhydramine": ("antihistamine", "allergies and sleeplessness", "25-50 mg every 4-6 h", 300, False),
}

INTERACTIONS = {
    frozenset({"ibuprofen", "warfarin"}): ("major", "raises bleeding risk"),
    frozenset({"naproxen", "warfarin"}): ("major", "raises bleeding risk"),
    frozenset({"aspirin", "warfarin"}): ("major", "raises bleeding risk"),
    frozenset({"acetaminophen", "warfarin"}): ("moderate", "regular use can raise INR"),
    frozenset({"ibuprofen", "lisinopril"}): ("moderate", "can blunt blood-pressure control and strain kidneys"),
    frozenset({"naproxen", "lisinopril"}): ("moderate", "can blunt blood-pressure control and strain kidneys"),
    frozenset({"ibuprofen", "sertraline"}): ("moderate", "more risk of stomach bleeding"),
    frozenset({"aspirin", "sertraline"}): ("moderate", "more risk of stomach bleeding"),
    frozenset({"ibuprofen", "aspirin"}): ("moderate", "ibuprofen can weaken aspirin's heart protection"),
    frozenset({"diphenhydramine", "sertraline"}): ("minor", "extra drowsiness"),
    frozenset({"metformin", "lisinopril"}): ("minor", "blood sugar may dip slightly"),
}

VACCINES = [  # (from age in months, vaccines)
    (0, ["HepB"]),
    (2, ["DTaP", "IPV", "Hib", "PCV", "rotavirus", "HepB"]),
    (6, ["DTaP", "PCV", "flu (yearly)"]),
    (12, ["MMR", "varicella", "HepA", "PCV"]),
    (48, ["DTaP", "IPV", "MMR", "varicella"]),
    (132, ["Tdap", "HPV", "MenACWY"]),
    (216, ["flu (yearly)", "Td/Tdap every 10 years"]),
    (600, ["shingles (2 doses)", "flu (yearly)", "Td/Tdap every 10 years"]),
    (780, ["pneumococcal", "shingles (2 doses)", "flu (yearly)"]),
]

CITIES = [
    "Austin",
    "Denver",
    "Leeds",
    "Toronto",
    "Dublin",
    "Melbourne",
    "Portland",
    "Madison",
    "Bristol",
    "Ottawa",
    "Raleigh",
    "Tucson",
    "Glasgow",
    "Auckland",
    "Boise",
    "Halifax",
    "Malmö",
    "Cork",
    "Perth",
    "Calgary",
]
SPECIALTIES = [
    "family medicine",
    "pediatrics",
    "dermatology",
    "urgent care",
    "physiotherapy",
    "cardiology",
    "women's health",
]
REASONS = {
    "family medicine": ["a check-up", "a follow-up", "a sinus infection"],
    "pediatrics": ["a check-up", "vaccinations", "an ear infection"],
    "dermatology": ["a rash", "a mole check", "acne"],
    "urgent care": ["a sprained ankle", "a bad cut", "a high fever"],
    "physiotherapy": ["knee pain", "back pain", "a shoulder injury"],
    "cardiology": ["palpitations", "a follow-up", "a blood pressure review"],
    "women's health": ["a check-up", "a contraception review", "a follow-up"],
}
CLINIC_WORDS = [
    "Riverside",
    "Northgate",
    "Maple",
    "Harbor",
    "Cedar",
    "Lakeside",
    "Summit",
    "Oak Park",
    "Westview",
    "Elm Street",
    "Hillcrest",
    "Bayview",
]
STREETS = ["Main St", "King St", "Park Ave", "Mill Rd", "High St", "Elm St", "Queen St", "Lake Rd"]
NAMES = [
    "Amara",
    "Ben",
    "Chloé",
    "Dev",
    "Elena",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jonas",
    "Kemi",
    "Liam",
    "Mei",
    "Noah",
    "Olga",
    "Priya",
    "Rafael",
    "Sara",
    "Tomás",
    "Uma",
    "Viktor",
    "Yara",
    "Zoë",
]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]


def article(drug_class: str) -> str:
    """'an NSAID', 'a statin': by sound, which the first letter alone does not tell."""
    an = {"NSAID", "SSRI", "ACE", "analgesic", "antihistamine", "anticoagulant"}
    return "an" if drug_class.split()[0] in an else "a"


def bmi_category(bmi: float) -> str:
    if bmi < 18.5:
        return "underweight"
    if bmi < 25:
        return "healthy"
    return "overweight" if bmi < 30 else "obese"


CONVERSIONS = {
    ("lb", "kg"): lambda v: v * 0.45359237,
    ("kg", "lb"): lambda v: v / 0.45359237,
    ("in", "cm"): lambda v: v * 2.54,
    ("cm", "in"): lambda v: v / 2.54,
    ("F", "C"): lambda v: (v - 32) * 5 / 9,
    ("C", "F"): lambda v: v * 9 / 5 + 32,
    ("mg/dL", "mmol/L"): lambda v: v / 18.0,
    ("mmol/L", "mg/dL"): lambda v: v * 18.0,
}


def run_tool(rng: random.Random, name: str, a: dict) -> dict:
    """What the tool returns, computed from its arguments."""
    if name == "lookup_medication":
        cls, uses, dose, max_mg, rx = MEDS[a["name"]]
        out = {"class": cls, "uses": uses, "adult_dose": dose}
        if max_mg:
            out["max_daily_mg"] = max_mg
        out["prescription"] = rx
        return out
    if name == "check_drug_interaction":
        severity, note = INTERACTIONS.get(frozenset({a["drug_a"], a["drug_b"]}), ("none", "no known interaction"))
        return {"severity": severity, "note": note}
    if name == "find_nearby_clinic":
        words = rng.sample(CLINIC_WORDS, 2)
        kind = {
            "urgent care": "Urgent Care",
            "pediatrics": "Children's Clinic",
            "dermatology": "Skin Clinic",
            "physiotherapy": "Physio",
            "cardiology": "Heart Centre",
        }.get(a.get("specialty"), "Health Centre")
        return {
            "clinics": [
                {"name": f"{w} {kind}", "address": f"{rng.randint(2, 480)} {rng.choice(STREETS)}"} for w in words
            ],
            "open_until": f"{rng.choice([17, 18, 19, 20])}:00",
        }
    if name == "schedule_appointment":
        return {"status": "confirmed", "confirmation": f"APT-{rng.randint(10000, 99999)}"}
    if name == "log_symptom":
        return {"status": "logged", "entry_id": rng.randint(100, 999)}
    if name == "get_bmi":
        bmi = round(a["weight_kg"] / (a["height_cm"] / 100) ** 2, 1)
        return {"bmi": bmi, "category": bmi_category(bmi)}
    if name == "get_vaccination_schedule":
        months = a["age"] * (12 if a["unit"] == "years" else 1)
        due = [v for start, v in VACCINES if start <= months][-1]
        return {"due": due}
    if name == "convert_units":
        value = CONVERSIONS[(a["from_unit"], a["to_unit"])](a["value"])
        return {"value": round(value, 1), "unit": a["to_unit"]}
    if name == "daily_water_intake":
        ml = round((35 * a["weight_kg"] + 12 * a.get("exercise_min", 0)) / 50) * 50
        return {"ml_per_day": ml, "litres": round(ml / 1000, 1)}
    if name == "daily_calories":
        bmr = 10 * a["weight_kg"] + 6.25 * a["height_cm"] - 5 * a["age"] + (5 if a["sex"] == "male" else -161)
        factor = {"low": 1.2, "moderate": 1.55, "high": 1.725}[a["activity"]]
        return {"bmr": round(bmr), "kcal_per_day": round(bmr * factor / 10) * 10}
    raise KeyError(name)


# --------------------------------------------------------------------------------------------
# A conversation under construction.


class Chat:
    def __init__(self, rng: random.Random):
        self.rng = rng
        self.messages: list[dict] = []
        self.needed: list[str] = []

    def user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def say(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    def call(self, *calls: tuple[str, dict], content: str | None = None) -> list[dict]:
        """One assistant turn with one or more (parallel) calls; returns the results in order."""
        ids = ["call_" + "".join(self.rng.choices(string.ascii_lowercase + string.digits, k=8)) for _ in calls]
        self.messages.append(
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {"id": i, "type": "function", "function": {"name": n, "arguments": dumps(a)}}
                    for i, (n, a) in zip(ids, calls)
                ],
            }
        )
        results = []
        for i, (n, a) in zip(ids, calls):
            result = run_tool(self.rng, n, a)
            self.messages.append({"role": "tool", "tool_call_id": i, "content": dumps(result)})
            results.append(result)
            if n not in self.needed:
                self.needed.append(n)
        return results


def pick(rng: random.Random, *options: str) -> str:
    return rng.choice(options)


def greet(rng: random.Random, text: str, question: bool = True) -> str:
    """`text`, sometimes after a greeting."""
    hello = pick(
        rng,
        "",
        "",
        "",
        "",
        "Hi! ",
        "Hello. ",
        "Hey! ",
        f"Hi, I'm {rng.choice(NAMES)}. ",
        "Quick question: " if question else "",
    )
    return hello + (text[0].upper() + text[1:] if hello else text)


def when(rng: random.Random) -> tuple[str, str]:
    """A future date as the user says it and as ISO."""
    d = date(2025, 1, 6) + timedelta(days=rng.randint(0, 330))
    spoken = pick(rng, f"{MONTHS[d.month - 1]} {d.day}", f"{d.day} {MONTHS[d.month - 1]}", d.isoformat())
    return spoken, d.isoformat()


def clock(rng: random.Random) -> tuple[str, str]:
    h, m = rng.choice([8, 9, 10, 11, 13, 14, 15, 16]), rng.choice([0, 15, 30, 45])
    spoken = f"{h if h <= 12 else h - 12}:{m:02d} {'am' if h < 12 else 'pm'}" if rng.random() < 0.5 else f"{h}:{m:02d}"
    return spoken, f"{h:02d}:{m:02d}"


# --------------------------------------------------------------------------------------------
# Scenarios. Each fills a Chat; the tools it calls are always offered.


def bmi(c: Chat) -> None:
    r = c.rng
    w, h = round(r.uniform(48, 115), r.choice([0, 1])), r.randint(150, 196)
    w = int(w) if w == int(w) else w
    c.user(
        greet(
            r,
            pick(
                r,
                f"I'm {h} cm and {w} kg. What's my BMI?",
                f"Can you check my BMI? Weight {w} kg, height {h} cm.",
                f"BMI for {w}kg {h}cm pls",
                f"My doctor mentioned BMI. I weigh {w} kg and I'm {h} cm tall, where do I stand?",
            ),
        )
    )
    res = c.call(("get_bmi", {"weight_kg": w, "height_cm": h}))[0]
    tail = {
        "underweight": "A dietitian can help with healthy weight gain.",
        "healthy": "Healthy is 18.5-24.9, so you're in range.",
        "overweight": "Regular activity and balanced meals help.",
        "obese": "A GP can help you plan steps that suit you.",
    }[res["category"]]
    c.say(f"Your BMI is {res['bmi']} ({res['category']}). {tail}")


def bmi_imperial(c: Chat) -> None:
    r = c.rng
    lb, ft, inch = r.randint(110, 250), r.randint(5, 6), r.randint(0, 11)
    if ft == 6:
        inch = min(inch, 4)
    total_in = ft * 12 + inch
    c.user(
        greet(
            r,
            pick(
                r, f"I'm {ft}'{inch}\" and {lb} lb. BMI?", f"What's the BMI for someone {ft} ft {inch} in, {lb} pounds?"
            ),
        )
    )
    kg, cm = c.call(
        ("convert_units", {"value": lb, "from_unit": "lb", "to_unit": "kg"}),
        ("convert_units", {"value": total_in, "from_unit": "in", "to_unit": "cm"}),
    )
    res = c.call(("get_bmi", {"weight_kg": kg["value"], "height_cm": cm["value"]}))[0]
    c.say(f"That's {kg['value']:g} kg and {cm['value']:g} cm, which gives a BMI of {res['bmi']} ({res['category']}).")


def med_lookup(c: Chat) -> None:
    r = c.rng
    drug = r.choice(sorted(MEDS))
    c.user(
        greet(
            r,
            pick(
                r,
                f"What is {drug} used for?",
                f"How much {drug} can an adult take?",
                f"tell me about {drug}",
                f"Is {drug} prescription only?",
                f"My pharmacist gave me {drug}. What's the usual dose?",
            ),
        )
    )
    res = c.call(("lookup_medication", {"name": drug}))[0]
    limit = f", max {res['max_daily_mg']} mg a day" if "max_daily_mg" in res else ""
    rx = "Prescription only." if res["prescription"] else "Sold over the counter."
    c.say(
        f"{drug.capitalize()} is {article(res['class'])} {res['class']} for {res['uses']}. "
        f"Adult dose: {res['adult_dose']}{limit}. {rx}"
    )


def interaction(c: Chat) -> None:
    r = c.rng
    if r.random() < 0.6:
        a, b = sorted(r.choice(sorted(INTERACTIONS, key=sorted)))
    else:
        a, b = r.sample(sorted(MEDS), 2)
    who = pick(r, "I", "my mom", "my dad", "my partner", "my grandmother")
    c.user(
        greet(
            r,
            pick(
                r,
                f"Can {who} take {a} with {b}?",
                f"Is it safe to mix {a} and {b}?",
                f"{a} + {b}, any problem?",
                f"Does {a} interact with {b}?",
            ),
        )
    )
    res = c.call(("check_drug_interaction", {"drug_a": a, "drug_b": b}))[0]
    if res["severity"] == "none":
        c.say(f"No known interaction between {a} and {b}; they're generally fine together.")
        return
    advice = {
        "major": "Avoid it unless a doctor approves.",
        "moderate": "Check with a pharmacist first.",
        "minor": "Usually fine, just be aware.",
    }[res["severity"]]
    c.say(f"It's a {res['severity']} interaction: {res['note']}. {advice}")


def two_meds(c: Chat) -> None:
    r = c.rng
    a, b = r.sample(sorted(MEDS), 2)
    c.user(
        greet(
            r,
            pick(
                r,
                f"What's the difference between {a} and {b}?",
                f"Compare {a} and {b} for me.",
                f"I have {a} and {b} at home. What is each for?",
            ),
        )
    )
    ra, rb = c.call(("lookup_medication", {"name": a}), ("lookup_medication", {"name": b}))
    c.say(
        f"{a.capitalize()} is {article(ra['class'])} {ra['class']} for {ra['uses']} ({ra['adult_dose']}). "
        f"{b.capitalize()} is {article(rb['class'])} {rb['class']} for {rb['uses']} ({rb['adult_dose']})."
    )


def safe_painkiller(c: Chat) -> None:
    r = c.rng
    current = r.choice(["warfarin", "lisinopril", "sertraline"])
    who = pick(r, "I take", "My dad takes", "My mother is on", "I'm on")
    c.user(greet(r, f"{who} {current}. Which is safer for a headache, ibuprofen or acetaminophen?"))
    ri, ra = c.call(
        ("check_drug_interaction", {"drug_a": current, "drug_b": "ibuprofen"}),
        ("check_drug_interaction", {"drug_a": current, "drug_b": "acetaminophen"}),
    )
    c.say(
        f"With {current}: ibuprofen {ri['severity']} ({ri['note']}); acetaminophen {ra['severity']} "
        f"({ra['note']}). Acetaminophen is the safer pick."
    )


def clinic_and_book(c: Chat) -> None:
    r = c.rng
    city, spec = r.choice(CITIES), r.choice(SPECIALTIES)
    spoken, iso = when(r)
    t_spoken, t_iso = clock(r)
    reason = r.choice(REASONS[spec])
    a_spec = ("an " if spec[0] in "aeiou" else "a ") + spec
    c.user(
        greet(
            r,
            pick(
                r,
                f"Find me {a_spec} clinic in {city} and book {spoken} at {t_spoken} for {reason}.",
                f"I need {a_spec} appointment in {city} on {spoken}, {t_spoken} if possible ({reason}).",
            ),
        )
    )
    res = c.call(("find_nearby_clinic", {"city": city, "specialty": spec}))[0]
    clinic = res["clinics"][0]
    conf = c.call(
        ("schedule_appointment", {"clinic": clinic["name"], "date": iso, "time": t_iso, "reason": reason}),
        content=f"{clinic['name']} looks good. Booking it." if r.random() < 0.3 else None,
    )[0]
    c.say(f"Booked {clinic['name']} ({clinic['address']}) on {iso} at {t_iso}, ref {conf['confirmation']}.")


def clinic_then_followup(c: Chat) -> None:
    r = c.rng
    city = r.choice(CITIES)
    spec = r.choice(SPECIALTIES) if r.random() < 0.6 else None
    args = {"city": city} | ({"specialty": spec} if spec else {})
    what = f"{spec} clinic" if spec else "clinic"
    a_what = ("an " if what[0] in "aeiou" else "a ") + what
    c.user(
        greet(
            r,
            pick(
                r,
                f"Is there {a_what} near me in {city}?",
                f"Any {what} in {city} open late?",
                f"I just moved to {city}. Where's {a_what}?",
            ),
        )
    )
    res = c.call(("find_nearby_clinic", args))[0]
    a, b = res["clinics"]
    c.say(f"Try {a['name']} ({a['address']}) or {b['name']} ({b['address']}), open until {res['open_until']}.")
    if c.rng.random() < 0.7:
        spoken, iso = when(r)
        t_spoken, t_iso = clock(r)
        choice = r.choice([a, b])
        c.user(
            pick(
                r,
                f"Book {choice['name']} for {spoken} at {t_spoken}.",
                f"Great, can I get {spoken} at {t_spoken} at {choice['name']}?",
            )
        )
        conf = c.call(("schedule_appointment", {"clinic": choice["name"], "date": iso, "time": t_iso}))[0]
        c.say(f"Done: {iso} at {t_iso}, ref {conf['confirmation']}.")


SYMPTOMS = [
    "headache",
    "sore throat",
    "lower back pain",
    "nausea",
    "dizziness",
    "cough",
    "migraine",
    "fatigue",
    "ankle pain",
    "itchy rash",
]


def symptom(c: Chat) -> None:
    r = c.rng
    s, sev = r.choice(SYMPTOMS), r.randint(2, 8)
    since = pick(r, "since this morning", "for two days", "after my run", "since last night", "on and off all week")
    c.user(
        greet(
            r,
            pick(
                r,
                f"Please log {s}, {sev}/10, {since}.",
                f"Log a symptom: {s}, severity {sev}, {since}.",
                f"I've had {s} {since}. I'd rate it {sev} out of 10, can you note it?",
            ),
        )
    )
    res = c.call(("log_symptom", {"symptom": s, "severity": sev, "notes": since}))[0]
    c.say(f"Logged {s} at {sev}/10 (entry {res['entry_id']}).")
    if r.random() < 0.5:
        c.user(pick(r, "Should I be worried?", "When should I see a doctor?", "Anything I can do meanwhile?"))
        if sev >= 7:
            c.say("At that level, see a doctor soon; urgent care if it worsens.")
        else:
            c.say("Rest and fluids often help. See a doctor if it lasts a week or worsens.")


def vaccines(c: Chat) -> None:
    r = c.rng
    if r.random() < 0.5:
        age, unit = r.choice([2, 6, 12, 18]), "months"
        who = pick(r, "My baby", "My son", "My daughter", "Our little one")
        c.user(greet(r, f"{who} is {age} months old. Which vaccines are due?"))
    else:
        age, unit = r.choice([4, 5, 11, 12, 30, 45, 52, 60, 67, 72]), "years"
        c.user(
            greet(r, pick(r, f"I'm {age}. Which vaccines should I have?", f"What shots does a {age}-year-old need?"))
        )
    res = c.call(("get_vaccination_schedule", {"age": age, "unit": unit}))[0]
    at = f"{age} months" if unit == "months" else f"{age}"
    c.say(f"At {at} the usual schedule lists {', '.join(res['due'])}. Your clinic can check your records.")


def conversion(c: Chat) -> None:
    r = c.rng
    kind = r.choice(["temp", "glucose", "weight"])
    if kind == "temp":
        f = round(r.uniform(97.0, 103.5), 1)
        c.user(greet(r, pick(r, f"My thermometer says {f} F. What's that in Celsius?", f"{f}°F in °C?")))
        res = c.call(("convert_units", {"value": f, "from_unit": "F", "to_unit": "C"}))[0]
        note = (
            "That's a fever; see a doctor if it passes 39.5 C or lasts 3 days."
            if res["value"] >= 38
            else "That's not a fever."
        )
        c.say(f"{f} F is {res['value']} C. {note}")
    elif kind == "glucose":
        g = r.randint(70, 240)
        c.user(
            greet(
                r, pick(r, f"My meter reads {g} mg/dL. What is that in mmol/L?", f"Convert glucose {g} mg/dL to mmol/L")
            )
        )
        res = c.call(("convert_units", {"value": g, "from_unit": "mg/dL", "to_unit": "mmol/L"}))[0]
        high = " If that was fasting, mention it to your doctor." if g >= 126 else ""
        c.say(f"{g} mg/dL is {res['value']} mmol/L.{high}")
    else:
        kg = r.randint(45, 120)
        c.user(greet(r, pick(r, f"How many pounds is {kg} kg?", f"{kg} kg in lb?")))
        res = c.call(("convert_units", {"value": kg, "from_unit": "kg", "to_unit": "lb"}))[0]
        c.say(f"{kg} kg is about {res['value']} lb.")


def water(c: Chat) -> None:
    r = c.rng
    w, mins = r.randint(50, 110), r.choice([0, 20, 30, 45, 60, 90])
    act = "I don't exercise much" if mins == 0 else f"I work out {mins} minutes a day"
    c.user(
        greet(
            r, pick(r, f"How much water should I drink? I'm {w} kg and {act}.", f"{w} kg, {act}. Daily water target?")
        )
    )
    args = {"weight_kg": w} | ({"exercise_min": mins} if mins else {})
    res = c.call(("daily_water_intake", args))[0]
    c.say(f"Aim for about {res['litres']} L a day, more in hot weather.")


def calories(c: Chat) -> None:
    r = c.rng
    sex, age = r.choice(["female", "male"]), r.randint(19, 70)
    w, h = r.randint(50, 105), r.randint(152, 193)
    act = r.choice(["low", "moderate", "high"])
    word = {"low": "mostly sitting", "moderate": "moderately active", "high": "very active"}[act]
    person = {"female": pick(r, "woman", "female"), "male": pick(r, "man", "male")}[sex]
    with_bmi = r.random() < 0.5
    c.user(
        greet(
            r,
            f"I'm a {age}-year-old {person}, {w} kg, {h} cm, {word}. How many calories do I need"
            + (", and what's my BMI?" if with_bmi else "?"),
        )
    )
    args = {"sex": sex, "age": age, "weight_kg": w, "height_cm": h, "activity": act}
    if with_bmi:
        cal, b = c.call(("daily_calories", args), ("get_bmi", {"weight_kg": w, "height_cm": h}))
        c.say(f"About {cal['kcal_per_day']} kcal a day; BMI {b['bmi']} ({b['category']}).")
    else:
        cal = c.call(("daily_calories", args))[0]
        c.say(f"Roughly {cal['kcal_per_day']} kcal a day to keep your weight (BMR {cal['bmr']}).")


def ask_first(c: Chat) -> None:
    """The assistant asks for what it is missing before calling."""
    r = c.rng
    if r.random() < 0.5:
        c.user(greet(r, pick(r, "Can you work out my BMI?", "What's my BMI?")))
        c.say("Sure. What are your weight (kg) and height (cm)?")
        w, h = r.randint(50, 110), r.randint(152, 193)
        c.user(pick(r, f"{w} kg, {h} cm", f"{h} cm and {w} kg"))
        res = c.call(("get_bmi", {"weight_kg": w, "height_cm": h}))[0]
        c.say(f"Your BMI is {res['bmi']}, which is {res['category']}.")
    else:
        c.user(greet(r, pick(r, "I need to see a doctor.", "Help me book an appointment."), question=False))
        c.say("Happy to help. Which city are you in, and what is it for?")
        city, spec = r.choice(CITIES), r.choice(SPECIALTIES)
        c.user(f"{city}, I need {spec}.")
        res = c.call(("find_nearby_clinic", {"city": city, "specialty": spec}))[0]
        a = res["clinics"][0]
        c.say(f"{a['name']} at {a['address']} is open until {res['open_until']}. Shall I book?")


GENERAL = [
    (
        "How many hours of sleep do adults need?",
        "Most adults do best with 7-9 hours. A steady bedtime, a dark cool room and no screens late help.",
    ),
    (
        "What's a normal resting heart rate?",
        "For adults it's usually 60-100 beats per minute; fit people sit lower. "
        "See a doctor if it's often above 100 at rest.",
    ),
    (
        "Any tips for lower back pain from sitting all day?",
        "Stand up every 30-45 minutes, set your screen at eye level, and try gentle stretches. "
        "Pain lasting weeks needs a check.",
    ),
    (
        "How much exercise should I get each week?",
        "Aim for 150 minutes of moderate activity, like brisk walking, plus two days of strength work.",
    ),
    (
        "Is it bad to skip breakfast?",
        "Not for most healthy adults; total diet quality matters more. People with diabetes should follow their plan.",
    ),
    (
        "How can I tell a cold from the flu?",
        "Flu tends to start suddenly with fever, aches and exhaustion; "
        "colds are milder and mostly in the nose and throat.",
    ),
    (
        "What helps with stress?",
        "Regular exercise, sleep, time outdoors, and talking to someone help. "
        "If it's affecting daily life, a GP can point you to support.",
    ),
    (
        "How often should I replace my toothbrush?",
        "Every 3-4 months, or sooner if the bristles fray or after you've been ill.",
    ),
    (
        "Is coffee dehydrating?",
        "Not in normal amounts; a few cups count toward your fluids. Keep it under about 400 mg caffeine a day.",
    ),
    (
        "How long should I wash my hands?",
        "At least 20 seconds with soap, covering backs, thumbs and between the fingers.",
    ),
]

URGENT = [
    "My chest hurts and the pain is spreading to my left arm.",
    "My friend suddenly can't speak properly and one side of her face is drooping.",
    "I took way too many pills by accident.",
    "My child is struggling to breathe and her lips look blue.",
]


def no_tool(c: Chat) -> None:
    r = c.rng
    if r.random() < 0.25:
        c.user(r.choice(URGENT))
        c.say(
            "This could be an emergency. Call your local emergency number (911, 999 or 112) right now. "
            "Don't wait to see if it passes."
        )
        return
    q, a = r.choice(GENERAL)
    c.user(greet(r, q))
    c.say(a)
    if r.random() < 0.35:
        q2, a2 = r.choice([g for g in GENERAL if g[0] != q])
        c.user(pick(r, "Thanks! Also: ", "And ", "One more: ") + q2[0].lower() + q2[1:])
        c.say(a2)


def followup_mix(c: Chat) -> None:
    """A tool answer, then a follow-up that needs a different tool."""
    r = c.rng
    drug = r.choice(["ibuprofen", "naproxen", "aspirin", "diphenhydramine"])
    c.user(greet(r, f"What's the max daily dose of {drug}?"))
    res = c.call(("lookup_medication", {"name": drug}))[0]
    c.say(f"Adults: {res['adult_dose']}, up to {res['max_daily_mg']} mg a day.")
    other = r.choice(["warfarin", "lisinopril", "sertraline", "metformin"])
    c.user(pick(r, f"I also take {other}. Is that a problem?", f"Okay. And with {other}?"))
    res = c.call(("check_drug_interaction", {"drug_a": drug, "drug_b": other}))[0]
    if res["severity"] == "none":
        c.say(f"No known interaction between {drug} and {other}.")
    else:
        c.say(f"Yes, {res['severity']}: {res['note']}. Ask your pharmacist first.")


SCENARIOS = [  # (builder, weight): short single-call chats dominate to keep byte sequences short
    (bmi, 9),
    (bmi_imperial, 3),
    (med_lookup, 10),
    (interaction, 10),
    (two_meds, 4),
    (safe_painkiller, 3),
    (clinic_and_book, 4),
    (clinic_then_followup, 5),
    (symptom, 8),
    (vaccines, 7),
    (conversion, 8),
    (water, 5),
    (calories, 4),
    (ask_first, 6),
    (no_tool, 15),
    (followup_mix, 3),
]

SYSTEM_PROMPTS = [
    "You are Vita, a health assistant. Use tools; never diagnose.",
    "You are a careful health assistant. Be brief; flag emergencies.",
    "You are a friendly wellness coach. Keep answers short.",
    "Help with medications, appointments and health questions.",
    "Health assistant. Use tools for lookups and math. Not a doctor.",
]


def make_conversation(rng: random.Random) -> dict:
    builders, weights = zip(*SCENARIOS)
    chat = Chat(rng)
    rng.choices(builders, weights)[0](chat)
    # Offer the tools it needs plus maybe one other, in a shuffled order; some tool-free chats offer none.
    others = [n for n in sorted(TOOLS) if n not in chat.needed]
    extra = rng.choice([0, 0, 0, 1]) if chat.needed else rng.choice([0, 1, 2])
    offered = chat.needed + rng.sample(others, max(0, min(extra, 3 - len(chat.needed))))
    rng.shuffle(offered)
    system = {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}
    return {"messages": [system] + chat.messages, "tools": [TOOLS[n] for n in offered]}


def generate(seed: int = SEED, rows: int = ROWS) -> str:
    rng = random.Random(seed)
    return "".join(dumps(make_conversation(rng)) + "\n" for _ in range(rows))


def print_stats(text: str) -> None:
    from phalanx.models.presets import build_embedded_tokenizer

    tok = build_embedded_tokenizer()
    rows = [json.loads(line) for line in text.splitlines()]
    lengths = sorted(
        len(tok.apply_chat_template(r["messages"], tools=r["tools"] or None, tokenize=False).encode()) for r in rows
    )
    n = len(lengths)
    tokens = sorted(
        len(tok.apply_chat_template(r["messages"], tools=r["tools"] or None, return_dict=True)["input_ids"])
        for r in rows
    )
    q = lambda p: lengths[min(n - 1, int(p * n))]  # noqa: E731
    print(
        f"rows={n} file_bytes={len(text.encode())} rendered bytes: mean={sum(lengths) / n:.0f} "
        f"min={lengths[0]} p25={q(0.25)} p50={q(0.5)} p75={q(0.75)} p90={q(0.9)} max={lengths[-1]} "
        f"under_1024={sum(x < 1024 for x in lengths) / n:.0%}; tokens: mean={sum(tokens) / n:.0f} "
        f"p50={tokens[n // 2]} max={tokens[-1]} under_1024={sum(x < 1024 for x in tokens) / n:.0%}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--rows", type=int, default=ROWS)
    ap.add_argument("--stats", action="store_true", help="print rendered-length statistics (needs phalanx)")
    args = ap.parse_args()
    text = generate(args.seed, args.rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_bytes(text.encode("utf-8"))
    tmp.replace(args.out)
    print(f"wrote {args.rows} conversations to {args.out}")
    if args.stats:
        print_stats(text)


if __name__ == "__main__":
    main()
