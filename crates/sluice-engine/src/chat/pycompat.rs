//! What transformers' Jinja environment takes from Python and minijinja does not do alike:
//! printing `None`, booleans and floats as Python does, transformers' `tojson` (Python's
//! `json.dumps` formatting) and `strftime_now` with its own calendar (no time-zone database).

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind, State};

// ---------------------------------------------------------------------------------------------
// Python-flavoured printing

/// Python's `repr(float)` (which is also its `str`): shortest round-trip digits, scientific
/// notation outside 1e-4..1e16, always a `.0` or exponent.
pub(super) fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf".into() } else { "-inf".into() };
    }
    let sci = format!("{f:e}");
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let mut s = format!("{f}");
        if !s.contains('.') {
            s.push_str(".0");
        }
        s
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mant}e{sign}{:02}", exp.abs())
    }
}

/// `Some(text)` where Python's `str()` prints a scalar differently from minijinja.
fn py_scalar_str(v: &Value) -> Option<String> {
    match v.kind() {
        ValueKind::None => Some("None".into()),
        ValueKind::Bool => Some(if v.is_true() { "True" } else { "False" }.into()),
        ValueKind::Number if !v.is_integer() => f64::try_from(v.clone()).ok().map(py_float),
        _ => None,
    }
}

pub(super) fn py_formatter(
    out: &mut minijinja::Output<'_>,
    state: &State<'_, '_>,
    value: &Value,
) -> Result<(), Error> {
    match py_scalar_str(value) {
        Some(s) => out.write_str(&s).map_err(Error::from),
        None => minijinja::escape_formatter(out, state, value),
    }
}

pub(super) fn py_string_filter(value: &Value) -> Value {
    match py_scalar_str(value) {
        Some(s) => Value::from(s),
        None if value.kind() == ValueKind::String => value.clone(),
        None if value.is_undefined() => Value::from(""),
        None => Value::from(value.to_string()),
    }
}

// ---------------------------------------------------------------------------------------------
// tojson: transformers' `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
// sort_keys=sort_keys)`

struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

pub(super) fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_string()),
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.clamp(0, 64) as usize)),
            None => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ))
            }
        },
    };
    let (item_sep, key_sep) = match kwargs.get::<Option<Value>>("separators")? {
        Some(v) if !v.is_none() => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .unwrap_or_default();
            match <[String; 2]>::try_from(parts) {
                Ok([a, b]) => (a, b),
                Err(_) => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(Value::from(out))
}

fn write_json(out: &mut String, v: &Value, style: &JsonStyle, depth: usize) -> Result<(), Error> {
    if depth > 128 {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: nesting too deep",
        ));
    }
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                let _ = write!(out, "{v}");
            } else {
                let f = f64::try_from(v.clone())?;
                if f.is_nan() {
                    out.push_str("NaN");
                } else if f.is_infinite() {
                    out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
                } else {
                    out.push_str(&py_float(f));
                }
            }
        }
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or(""), style.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            write_container(out, style, depth, '[', ']', items.len(), |out, i| {
                write_json(out, &items[i], style, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for k in v.try_iter()? {
                let val = v.get_item(&k)?;
                entries.push((json_key(&k)?, val));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(out, style, depth, '{', '}', entries.len(), |out, i| {
                write_json_str(out, &entries[i].0, style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_json(out, &entries[i].1, style, depth + 1)
            })?;
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a {} value is not JSON serializable", v.kind()),
            ));
        }
    }
    Ok(())
}

fn write_container(
    out: &mut String,
    style: &JsonStyle,
    depth: usize,
    open: char,
    close: char,
    len: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..len {
        if i > 0 {
            out.push_str(&style.item_sep);
        }
        if let Some(ind) = &style.indent {
            out.push('\n');
            for _ in 0..=depth {
                out.push_str(ind);
            }
        }
        item(out, i)?;
    }
    if let Some(ind) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
    out.push(close);
    Ok(())
}

/// Python turns str, int, float, bool and None keys into strings.
fn json_key(k: &Value) -> Result<String, Error> {
    Ok(match k.kind() {
        ValueKind::String => k.as_str().unwrap_or("").to_string(),
        ValueKind::Number if k.is_integer() => k.to_string(),
        ValueKind::Number => py_float(f64::try_from(k.clone())?),
        ValueKind::Bool => if k.is_true() { "true" } else { "false" }.to_string(),
        ValueKind::None => "null".to_string(),
        other => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be strings, not {other}"),
            ))
        }
    })
}

/// Python's JSON string escaping.
fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

// ---------------------------------------------------------------------------------------------
// strftime_now

/// Days since 1970-01-01 to (year, month 1..=12, day 1..=31) (proleptic Gregorian).
pub(super) fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// (year, month 1..=12, day 1..=31) to days since 1970-01-01.
pub(super) fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m as i64 + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

const MONTHS: [&str; 12] = [
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
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// C `strftime` over a Unix time (UTC) for the common directives; unknown ones are copied.
pub(super) fn strftime(fmt: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (y, mo, d) = civil_from_days(days);
    let (h, mi, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    let wd = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday; 0 = Monday
    let yday = days - days_from_civil(y, 1, 1) + 1;
    let mut out = String::new();
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let num = |out: &mut String, v: i64, width: usize| {
            if no_pad {
                let _ = write!(out, "{v}");
            } else {
                let _ = write!(out, "{v:0width$}");
            }
        };
        match chars.next() {
            Some('Y') => {
                let _ = write!(out, "{y}");
            }
            Some('y') => num(&mut out, y.rem_euclid(100), 2),
            Some('m') => num(&mut out, mo as i64, 2),
            Some('d') => num(&mut out, d as i64, 2),
            Some('e') => {
                let _ = write!(out, "{d:>2}");
            }
            Some('H') => num(&mut out, h, 2),
            Some('I') => num(&mut out, (h + 11) % 12 + 1, 2),
            Some('M') => num(&mut out, mi, 2),
            Some('S') => num(&mut out, s, 2),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('j') => num(&mut out, yday, 3),
            Some('B') => out.push_str(MONTHS[mo as usize - 1]),
            Some('b') | Some('h') => out.push_str(&MONTHS[mo as usize - 1][..3]),
            Some('A') => out.push_str(WEEKDAYS[wd]),
            Some('a') => out.push_str(&WEEKDAYS[wd][..3]),
            Some('u') => num(&mut out, wd as i64 + 1, 1),
            Some('w') => num(&mut out, (wd as i64 + 1) % 7, 1),
            Some('F') => {
                let _ = write!(out, "{y}-{mo:02}-{d:02}");
            }
            Some('T') => {
                let _ = write!(out, "{h:02}:{mi:02}:{s:02}");
            }
            Some('D') => {
                let _ = write!(out, "{mo:02}/{d:02}/{:02}", y.rem_euclid(100));
            }
            Some('Z') => out.push_str("UTC"),
            Some('z') => out.push_str("+0000"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// `strftime_now(fmt)`: the current time (UTC; the engine has no time-zone database).
pub(super) fn strftime_now(fmt: String) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&fmt, secs)
}
