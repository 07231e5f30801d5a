//! Text limits every feature shares: a message cut to a byte budget (an Event note, a condition
//! message, a status field) without splitting a character.

/// Cuts `s` to at most `max` bytes, at the last character boundary at or before `max`.
pub fn cut_at_char_boundary(s: &mut String, max: usize) {
    if s.len() <= max {
        return;
    }
    let mut cut = max;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    s.truncate(cut);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_at_the_byte_budget_without_splitting_a_character() {
        let mut s = "abc".to_string();
        cut_at_char_boundary(&mut s, 3);
        assert_eq!(s, "abc");
        cut_at_char_boundary(&mut s, 2);
        assert_eq!(s, "ab");
        // "é" is two bytes: a budget that falls inside it keeps what precedes it.
        let mut s = "aé".to_string();
        cut_at_char_boundary(&mut s, 2);
        assert_eq!(s, "a");
        let mut s = "é".to_string();
        cut_at_char_boundary(&mut s, 0);
        assert_eq!(s, "");
    }
}
