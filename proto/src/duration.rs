//! The one duration syntax of both command lines (`better-compute`, `bcd`): a number and a unit, `s`, `m`, `h` or
//! `d`, several in a row adding up (`90s`, `10m`, `1h30m`, `7d`). A bare number is refused with the spelling to use,
//! so `--timeout 600` can never mean milliseconds to one reader and seconds to another.

use std::time::Duration;

/// Parses `s` (clap's `value_parser`). The error says what was wrong and how to write it.
pub fn parse(s: &str) -> Result<Duration, String> {
    let text = s.trim();
    if text.is_empty() {
        return Err("a duration is empty: write e.g. 90s, 10m, 1h30m or 7d".into());
    }
    if text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "{text:?} has no unit: write {text}s (or m, h, d: 90s, 10m, 1h30m, 7d)"
        ));
    }
    let mut total: u64 = 0;
    let mut number = String::new();
    for c in text.chars() {
        if c.is_ascii_digit() {
            number.push(c);
            continue;
        }
        let unit: u64 = match c {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            'd' => 86_400,
            _ => {
                return Err(format!(
                    "{text:?}: {c:?} is not a unit (use s, m, h or d, e.g. 90s, 10m, 1h30m, 7d)"
                ));
            }
        };
        let n: u64 = number
            .parse()
            .map_err(|_| format!("{text:?}: a unit without a number before it (e.g. 10m)"))?;
        number.clear();
        total = n
            .checked_mul(unit)
            .and_then(|v| total.checked_add(v))
            .ok_or_else(|| format!("{text:?} is too long"))?;
    }
    if !number.is_empty() {
        return Err(format!(
            "{text:?} ends in a number without a unit: write {number}s, {number}m, {number}h or {number}d"
        ));
    }
    Ok(Duration::from_secs(total))
}

#[cfg(test)]
mod tests {
    use super::parse;
    use std::time::Duration;

    #[test]
    fn units_add_up_and_bare_numbers_are_refused_with_the_spelling() {
        assert_eq!(parse("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse(" 7d "), Ok(Duration::from_secs(604_800)));
        let bare = parse("600").expect_err("bare");
        assert!(bare.contains("write 600s"), "{bare}");
        assert!(parse("10x").expect_err("unit").contains("not a unit"));
        assert!(parse("1h30").expect_err("tail").contains("write 30s"));
        assert!(
            parse("h")
                .expect_err("no number")
                .contains("without a number")
        );
        assert!(parse("").is_err());
        assert!(parse("99999999999999999999d").is_err());
    }
}
