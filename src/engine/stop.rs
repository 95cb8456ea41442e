//! Stop strings over streamed text.
//!
//! A stop string can arrive split over several deltas, so any tail of the text that
//! could still grow into one is held back until it either completes (generation stops,
//! the stop string and everything after it are dropped, as OpenAI and vLLM do by
//! default) or diverges (the text is released).
//!
//! Text is checked as it arrives: with stops `["abc", "b"]` and deltas "a", "b", the
//! "b" matches before "abc" could complete. vLLM behaves the same way.

/// What to do with one pushed delta.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopOutcome {
    /// Text safe to send to the client now.
    pub emit: String,
    /// Index (into the stop list) of the stop string that ended generation.
    pub stopped: Option<usize>,
}

/// Per-sequence stop-string matcher.
#[derive(Debug, Clone)]
pub struct StopChecker {
    stops: Vec<String>,
    /// Tail of the text that is a prefix of some stop string; never contains a whole one.
    held: String,
    stopped: Option<usize>,
}

impl StopChecker {
    /// Empty stop strings are ignored (they would match everywhere); `validate()`
    /// rejects them earlier.
    pub fn new(stops: &[String]) -> Self {
        let stops = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        Self { stops, held: String::new(), stopped: None }
    }

    /// Whether a stop string has been seen; later pushes emit nothing.
    pub fn stopped(&self) -> Option<usize> {
        self.stopped
    }

    pub fn push(&mut self, delta: &str) -> StopOutcome {
        if self.stopped.is_some() {
            return StopOutcome { emit: String::new(), stopped: self.stopped };
        }
        if self.stops.is_empty() {
            return StopOutcome { emit: delta.to_string(), stopped: None };
        }
        let mut text = std::mem::take(&mut self.held);
        text.push_str(delta);

        // Earliest match wins; on equal positions, the first listed stop string. The
        // held part held no complete stop string, so searching all of `text` only
        // finds matches that involve the new delta.
        let first = self.stops.iter().enumerate().filter_map(|(i, s)| text.find(s.as_str()).map(|pos| (pos, i))).min();
        if let Some((pos, i)) = first {
            text.truncate(pos);
            self.stopped = Some(i);
            return StopOutcome { emit: text, stopped: Some(i) };
        }

        let keep = self.longest_partial_suffix(&text);
        self.held = text.split_off(text.len() - keep);
        StopOutcome { emit: text, stopped: None }
    }

    /// Release the held-back text at the end of generation (empty after a stop).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length in bytes of the longest suffix of `text` that is a proper prefix of a
    /// stop string. Such a suffix begins with a whole UTF-8 character (it equals the
    /// start of a `str`), so splitting there is on a char boundary.
    fn longest_partial_suffix(&self, text: &str) -> usize {
        self.stops
            .iter()
            .filter_map(|s| {
                // Proper, non-empty prefixes s[..i] for char boundaries i > 0, longest first.
                s.char_indices().rev().map(|(i, _)| i).find(|&i| i > 0 && text.ends_with(&s[..i]))
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checker(stops: &[&str]) -> StopChecker {
        StopChecker::new(&stops.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    /// Push all deltas; returns (emitted text incl. flush, stop index).
    fn run(stops: &[&str], deltas: &[&str]) -> (String, Option<usize>, Vec<String>) {
        let mut c = checker(stops);
        let mut pieces = Vec::new();
        let mut stopped = None;
        for d in deltas {
            let out = c.push(d);
            pieces.push(out.emit);
            stopped = stopped.or(out.stopped);
        }
        pieces.push(c.flush());
        (pieces.concat(), stopped, pieces)
    }

    #[test]
    fn no_stop_strings_is_passthrough() {
        let (text, stopped, pieces) = run(&[], &["he", "llo", ""]);
        assert_eq!((text.as_str(), stopped), ("hello", None));
        assert_eq!(pieces, vec!["he", "llo", "", ""]);
    }

    #[test]
    fn stop_split_across_deltas_is_held_then_cut() {
        let (text, stopped, pieces) = run(&["</end>"], &["ok </", "en", "d> tail", "more"]);
        assert_eq!((text.as_str(), stopped), ("ok ", Some(0)));
        assert_eq!(pieces, vec!["ok ", "", "", "", ""]);
    }

    #[test]
    fn held_text_is_released_when_it_diverges_or_at_flush() {
        let (text, stopped, pieces) = run(&["STOP"], &["a ST", "x", " ST"]);
        assert_eq!((text.as_str(), stopped), ("a STx ST", None));
        assert_eq!(pieces, vec!["a ", "STx", " ", "ST"]);
    }

    #[test]
    fn overlapping_candidates() {
        // "aab" with stop "ab": the first "a" can be released once a second "a" comes.
        let (text, stopped, pieces) = run(&["ab"], &["a", "a", "b"]);
        assert_eq!((text.as_str(), stopped), ("a", Some(0)));
        assert_eq!(pieces, vec!["", "a", "", ""]);
        // The longest partial match is held, across stop strings.
        let mut c = checker(&["xyz", "yq"]);
        assert_eq!(c.push("axy").emit, "a");
        assert_eq!(c.push("q").stopped, Some(1));
        // Earliest match wins within one delta; ties go to the first listed.
        assert_eq!(run(&["cd", "bc"], &["abcd"]).0, "a");
        assert_eq!(run(&["bc", "b"], &["abc"]).1, Some(0));
    }

    #[test]
    fn multi_byte_characters() {
        let (text, stopped, pieces) = run(&["日本"], &["こんにちは日", "本語"]);
        assert_eq!((text.as_str(), stopped), ("こんにちは", Some(0)));
        assert_eq!(pieces[0], "こんにちは");
        let (text, stopped, _) = run(&["é!"], &["café", " ok"]);
        assert_eq!((text.as_str(), stopped), ("café ok", None));
    }

    #[test]
    fn nothing_is_emitted_after_a_stop() {
        let mut c = checker(&["."]);
        assert_eq!(c.push("Hi. there").emit, "Hi");
        let out = c.push("more");
        assert_eq!((out.emit.as_str(), out.stopped), ("", Some(0)));
        assert_eq!(c.flush(), "");
    }
}
