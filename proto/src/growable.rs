//! Messages that grow: the `growable!` macro for structs whose fields each carry the protocol
//! minor they arrived in, and the peer's minor that their serde impls read.
//!
//! A field is added to a message by appending it with its minor (PROTOCOL.md §4). On the wire a
//! struct is its fields in order with nothing else, so a peer of an older minor reads exactly
//! the fields it knows and refuses anything after them. The side that speaks the higher minor
//! therefore adapts: it sends only the fields of the lower minor, and reads what the lower one
//! sends with [`Default`] for the fields it lacks.
//!
//! That needs the peer's minor inside `Serialize` and `Deserialize`, several levels down (a
//! `DeviceStats` in the `Vec` of a `NodeStats` in a `Response`), and serde has no context
//! parameter: a context would need a hand-written `DeserializeSeed` for every type on the way
//! down. So the minor travels in a thread-local, which only `control` sets, for the duration of
//! one encode or decode call. That call is synchronous from start to end (bincode over a byte
//! slice, no `.await` inside), so the value cannot leak to another message or another task.
//! Outside such a call the minor is [`PROTOCOL_MINOR`]: any other serde user (the CLI's JSON
//! output) sees every field, by name.

use std::cell::Cell;

use crate::frame::PROTOCOL_MINOR;

thread_local! {
    static PEER_MINOR: Cell<u16> = const { Cell::new(PROTOCOL_MINOR) };
}

/// The minor the message being encoded or decoded on this thread is for; [`PROTOCOL_MINOR`]
/// outside `control`'s calls.
pub(crate) fn peer_minor() -> u16 {
    PEER_MINOR.with(Cell::get)
}

/// Runs `f` (one encode or decode) with the peer's minor set to `minor`, and puts back the one
/// before afterwards, even if `f` panics.
pub(crate) fn as_of<R>(minor: u16, f: impl FnOnce() -> R) -> R {
    struct Restore(u16);
    impl Drop for Restore {
        fn drop(&mut self) {
            PEER_MINOR.with(|m| m.set(self.0));
        }
    }
    let _restore = Restore(PEER_MINOR.with(|m| m.replace(minor)));
    f()
}

/// Whether a field that arrived in minor `since` travels to or from a peer of minor `minor`.
/// (A function rather than `since <= minor` in the macro, where a `since` of 0 would be a
/// comparison clippy calls absurd.)
pub(crate) const fn on_wire(since: u16, minor: u16) -> bool {
    since <= minor
}

/// How many fields travel at `minor`: fields are appended in minor order, so they are a prefix.
pub(crate) const fn fields_at(since: &[u16], minor: u16) -> usize {
    let mut n = 0;
    while n < since.len() && on_wire(since[n], minor) {
        n += 1;
    }
    n
}

/// Whether the fields' minors never decrease and none is newer than this build: checked at
/// compile time for every growable struct, so a field can only be appended.
pub(crate) const fn in_minor_order(since: &[u16]) -> bool {
    let mut i = 0;
    while i < since.len() {
        if since[i] > PROTOCOL_MINOR || (i > 0 && since[i] < since[i - 1]) {
            return false;
        }
        i += 1;
    }
    true
}

/// A struct whose fields are grouped by the minor they arrived in, oldest first:
///
/// ```ignore
/// growable! {
///     /// Docs.
///     #[derive(Debug, Clone, PartialEq, Default)]
///     pub struct Example {
///         since 0 {
///             /// Docs.
///             pub a: u64,
///         }
///         since 3 {
///             /// Docs.
///             pub b: Option<String>,
///         }
///     }
/// }
/// ```
///
/// It defines the struct and its `Serialize` and `Deserialize`: a struct of the fields whose
/// minor is at most the peer's ([`peer_minor`]), in order; reading fills the others with
/// their `Default`. (A self-describing format such as JSON reads fields by name, a missing one
/// as its default.) Every field's type must implement `Default`.
macro_rules! growable {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $(
                since $since:literal {
                    $( $(#[$fmeta:meta])* $fvis:vis $field:ident : $ty:ty ),* $(,)?
                }
            )*
        }
    ) => {
        $(#[$meta])*
        $vis struct $name {
            $( $( $(#[$fmeta])* $fvis $field: $ty, )* )*
        }

        impl $name {
            /// Every field's name, in wire order.
            const FIELD_NAMES: &'static [&'static str] = &[$( $( stringify!($field), )* )*];
            /// The minor each field arrived in, in wire order.
            const FIELD_SINCE: &'static [u16] = &[$( $( { let _ = stringify!($field); $since }, )* )*];
        }

        const _: () = assert!(
            $crate::growable::in_minor_order($name::FIELD_SINCE),
            concat!(
                "the fields of ",
                stringify!($name),
                " must be appended in minor order, none past PROTOCOL_MINOR"
            )
        );

        impl ::serde::Serialize for $name {
            fn serialize<S: ::serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                use ::serde::ser::SerializeStruct as _;
                let minor = $crate::growable::peer_minor();
                let len = $crate::growable::fields_at(Self::FIELD_SINCE, minor);
                let mut out = serializer.serialize_struct(stringify!($name), len)?;
                $( $(
                    if $crate::growable::on_wire($since, minor) {
                        out.serialize_field(stringify!($field), &self.$field)?;
                    }
                )* )*
                out.end()
            }
        }

        impl<'de> ::serde::Deserialize<'de> for $name {
            fn deserialize<D: ::serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                struct Fields {
                    minor: u16,
                }

                impl<'de> ::serde::de::Visitor<'de> for Fields {
                    type Value = $name;

                    fn expecting(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                        write!(f, "{} as of protocol minor {}", stringify!($name), self.minor)
                    }

                    fn visit_seq<A: ::serde::de::SeqAccess<'de>>(
                        self,
                        mut seq: A,
                    ) -> Result<$name, A::Error> {
                        $( $(
                            let $field: $ty = if $crate::growable::on_wire($since, self.minor) {
                                seq.next_element()?.ok_or_else(|| {
                                    <A::Error as ::serde::de::Error>::custom(concat!(
                                        stringify!($name),
                                        " ends before its field ",
                                        stringify!($field)
                                    ))
                                })?
                            } else {
                                ::std::default::Default::default()
                            };
                        )* )*
                        Ok($name { $( $( $field, )* )* })
                    }

                    fn visit_map<A: ::serde::de::MapAccess<'de>>(
                        self,
                        mut map: A,
                    ) -> Result<$name, A::Error> {
                        $( $( let mut $field: Option<$ty> = None; )* )*
                        while let Some(key) = map.next_key::<::std::string::String>()? {
                            match key.as_str() {
                                $( $(
                                    stringify!($field) => {
                                        if $field.is_some() {
                                            return Err(<A::Error as ::serde::de::Error>::duplicate_field(
                                                stringify!($field),
                                            ));
                                        }
                                        $field = Some(map.next_value()?);
                                    }
                                )* )*
                                _ => {
                                    map.next_value::<::serde::de::IgnoredAny>()?;
                                }
                            }
                        }
                        Ok($name { $( $( $field: $field.unwrap_or_default(), )* )* })
                    }
                }

                let minor = $crate::growable::peer_minor();
                let len = $crate::growable::fields_at($name::FIELD_SINCE, minor);
                deserializer.deserialize_struct(
                    stringify!($name),
                    &$name::FIELD_NAMES[..len],
                    Fields { minor },
                )
            }
        }
    };
}

pub(crate) use growable;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_minor_is_set_for_one_call_and_put_back() {
        assert_eq!(peer_minor(), PROTOCOL_MINOR);
        let inner = as_of(3, || (peer_minor(), as_of(1, peer_minor), peer_minor()));
        assert_eq!(inner, (3, 1, 3));
        assert_eq!(peer_minor(), PROTOCOL_MINOR);
        let panicked = std::panic::catch_unwind(|| as_of(2, || panic!("in the middle")));
        assert!(panicked.is_err());
        assert_eq!(peer_minor(), PROTOCOL_MINOR, "put back after a panic too");
    }

    #[test]
    fn the_fields_of_a_minor_are_a_prefix() {
        let since = [0, 0, 1, 4, 4, 7];
        let counts: Vec<usize> = (0..=8).map(|minor| fields_at(&since, minor)).collect();
        assert_eq!(counts, [2, 3, 3, 3, 5, 5, 5, 6, 6]);
        assert!(in_minor_order(&since));
        assert!(!in_minor_order(&[0, 2, 1]));
        assert!(!in_minor_order(&[PROTOCOL_MINOR + 1]));
    }
}
