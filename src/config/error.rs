//! [`ConfigError`]: why a command line or a configuration is refused.

use std::fmt;

/// A command-line or configuration error: which flag, the value given and
/// why it is refused. Its `Display` is the message for a person.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// A flag's value does not parse: `invalid value 'VALUE' for FLAG: WHY`.
    Value {
        /// The flag, like `--max-conns`.
        flag: &'static str,
        /// The value as given.
        value: String,
        /// What was expected instead.
        why: String,
    },
    /// A flag is given without its value.
    NoValue {
        /// The flag.
        flag: &'static str,
    },
    /// A flag that takes one value is given twice.
    Repeated {
        /// The flag.
        flag: &'static str,
    },
    /// An argument no parser took (a misspelt flag, `--flag=value`).
    Unknown {
        /// The argument as given.
        arg: String,
    },
    /// Values that parse but are out of range, do not go together, or are
    /// refused by protected mode; the message names the flags.
    Invalid(String),
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Value { flag, value, why } => {
                write!(f, "invalid value '{value}' for {flag}: {why}")
            }
            ConfigError::NoValue { flag } => write!(f, "{flag} needs a value"),
            ConfigError::Repeated { flag } => write!(f, "{flag} is given more than once"),
            ConfigError::Unknown { arg } => {
                write!(f, "unknown argument '{arg}'")?;
                // `--flag=value` is not accepted: say how to write it.
                match arg.split_once('=') {
                    Some((name, value)) if name.starts_with("--") => {
                        write!(f, " (write the value after a space: {name} {value})")
                    }
                    _ => Ok(()),
                }
            }
            ConfigError::Invalid(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for ConfigError {}
