//! API objects decoded in two steps, so that a list's next page is on its way while this
//! one is decoded.
//!
//! kube-rs's watcher asks for the next list page only once every object of the current one
//! has been decoded and taken, and the in-repo API server (like a real one) encodes a page
//! only when asked: page after page, the server and the client took turns. A [`Lazy`] object
//! is what the watcher decodes instead: its metadata (which the watcher reads for resource
//! versions) and the text of its other fields, copied as they are scanned, with none of the
//! allocations of the object itself. The watcher's own task then only scans pages and asks
//! for the next; [`decode`] turns each into the full object in another task, alongside.

use std::{borrow::Cow, fmt, marker::PhantomData};

use k8s_openapi::{api::core::v1::ObjectReference, apimachinery::pkg::apis::meta::v1::ObjectMeta};
use kube::{Resource, runtime::watcher};
use serde::{
    Deserialize, Deserializer,
    de::{self, DeserializeOwned, DeserializeSeed, MapAccess, Visitor},
};

/// An object of kind `K` whose metadata is decoded and whose other fields are kept as text.
pub struct Lazy<K> {
    metadata: ObjectMeta,
    /// The other top-level fields as a JSON object's text without its closing brace:
    /// `{"spec":{...},"status":{...}`.
    fields: Vec<u8>,
    kind: PhantomData<fn() -> K>,
}

// Derived impls would ask `K` for them too.
impl<K> Clone for Lazy<K> {
    fn clone(&self) -> Self {
        Lazy {
            metadata: self.metadata.clone(),
            fields: self.fields.clone(),
            kind: PhantomData,
        }
    }
}

impl<K> fmt::Debug for Lazy<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lazy")
            .field("metadata", &self.metadata)
            .field("fields", &String::from_utf8_lossy(&self.fields))
            .finish()
    }
}

/// An object that could not be decoded: which one, and why.
#[derive(Clone, Debug)]
pub struct Malformed {
    pub object: ObjectReference,
    pub error: String,
}

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = self.object.kind.as_deref().unwrap_or("object");
        let ns = self.object.namespace.as_deref().unwrap_or("");
        let name = self.object.name.as_deref().unwrap_or("<unnamed>");
        let slash = if ns.is_empty() { "" } else { "/" };
        write!(
            f,
            "{kind} {ns}{slash}{name} cannot be decoded: {}",
            self.error
        )
    }
}

impl<K> Lazy<K>
where
    K: Resource<DynamicType = ()> + DeserializeOwned,
{
    /// The whole object, with the metadata decoded before.
    pub fn decode(self) -> Result<K, Box<Malformed>> {
        let object = self.object_ref(&());
        let mut fields = self.fields;
        fields.push(b'}');
        match serde_json::from_slice::<K>(&fields) {
            Ok(mut obj) => {
                *obj.meta_mut() = self.metadata;
                Ok(obj)
            }
            Err(e) => Err(Box::new(Malformed {
                object,
                error: e.to_string(),
            })),
        }
    }
}

impl<'de, K> Deserialize<'de> for Lazy<K> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Fields<K>(PhantomData<fn() -> K>);

        impl<'de, K> Visitor<'de> for Fields<K> {
            type Value = Lazy<K>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a Kubernetes object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Lazy<K>, A::Error> {
                let mut metadata = None;
                let mut fields = vec![b'{'];
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    if key == "metadata" {
                        metadata = Some(map.next_value::<ObjectMeta>()?);
                        continue;
                    }
                    if fields.len() > 1 {
                        fields.push(b',');
                    }
                    serde_json::to_writer(&mut fields, &key).map_err(de::Error::custom)?;
                    fields.push(b':');
                    map.next_value_seed(AppendJson(&mut fields))?;
                }
                Ok(Lazy {
                    metadata: metadata.unwrap_or_default(),
                    fields,
                    kind: PhantomData,
                })
            }
        }

        deserializer.deserialize_map(Fields(PhantomData))
    }
}

/// Appends the value being decoded to a buffer as JSON text. serde_json's `RawValue` would
/// copy the text as it is, but only from serde_json's own decoder: kube's watch events are
/// buffered by serde first (`WatchEvent` is a tagged enum).
struct AppendJson<'a>(&'a mut Vec<u8>);

impl<'de> DeserializeSeed<'de> for AppendJson<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        let mut out = serde_json::Serializer::new(self.0);
        serde_transcode::transcode(deserializer, &mut out).map_err(de::Error::custom)
    }
}

impl<K: Resource<DynamicType = ()>> Resource for Lazy<K> {
    type DynamicType = ();
    type Scope = K::Scope;

    fn kind(dt: &()) -> Cow<'_, str> {
        K::kind(dt)
    }

    fn group(dt: &()) -> Cow<'_, str> {
        K::group(dt)
    }

    fn version(dt: &()) -> Cow<'_, str> {
        K::version(dt)
    }

    fn plural(dt: &()) -> Cow<'_, str> {
        K::plural(dt)
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// A watcher event with its object decoded (or why it could not be).
pub type Decoded<K> = Result<watcher::Event<Result<K, Box<Malformed>>>, watcher::Error>;

/// Decodes the objects of a watcher event.
pub fn decode<K>(ev: Result<watcher::Event<Lazy<K>>, watcher::Error>) -> Decoded<K>
where
    K: Resource<DynamicType = ()> + DeserializeOwned,
{
    Ok(match ev? {
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitDone => watcher::Event::InitDone,
        watcher::Event::InitApply(obj) => watcher::Event::InitApply(obj.decode()),
        watcher::Event::Apply(obj) => watcher::Event::Apply(obj.decode()),
        watcher::Event::Delete(obj) => watcher::Event::Delete(obj.decode()),
    })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::discovery::v1::EndpointSlice;

    use super::*;

    const SLICE: &str = r#"{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice",
        "metadata":{"name":"web-abc","namespace":"demo","resourceVersion":"7",
                    "labels":{"kubernetes.io/service-name":"web"}},
        "addressType":"IPv4",
        "endpoints":[{"addresses":["198.18.0.10"],"conditions":{"ready":true},"nodeName":"n1"}],
        "ports":[{"name":"http","port":8080,"protocol":"TCP"}]}"#;

    #[test]
    fn a_lazy_object_decodes_to_what_a_direct_decode_gives() {
        let lazy: Lazy<EndpointSlice> = serde_json::from_str(SLICE).unwrap();
        assert_eq!(lazy.meta().resource_version.as_deref(), Some("7"));
        let direct: EndpointSlice = serde_json::from_str(SLICE).unwrap();
        assert_eq!(lazy.decode().unwrap(), direct);
    }

    #[test]
    fn list_items_without_kind_decode() {
        // A real API server's list items carry neither apiVersion nor kind.
        let item =
            r#"{"metadata":{"name":"s","namespace":"demo"},"addressType":"IPv6","endpoints":[]}"#;
        let lazy: Lazy<EndpointSlice> = serde_json::from_str(item).unwrap();
        let slice = lazy.decode().unwrap();
        assert_eq!(slice.address_type, "IPv6");
        assert_eq!(slice.metadata.name.as_deref(), Some("s"));
    }

    #[test]
    fn a_malformed_object_names_itself_and_the_fault() {
        let bad = r#"{"metadata":{"name":"s","namespace":"demo"},"addressType":"IPv4","endpoints":[{"addresses":"198.18.0.1"}]}"#;
        let lazy: Lazy<EndpointSlice> = serde_json::from_str(bad).unwrap();
        let err = lazy.decode().unwrap_err();
        assert_eq!(err.object.name.as_deref(), Some("s"));
        let text = err.to_string();
        assert!(
            text.starts_with("EndpointSlice demo/s cannot be decoded: "),
            "{text}"
        );
        assert!(text.contains("invalid type"), "{text}");
    }

    #[test]
    fn a_watch_event_decodes() {
        // kube decodes watch events through serde's buffered content, not serde_json.
        let event = format!(r#"{{"type":"MODIFIED","object":{SLICE}}}"#);
        let ev: kube::core::WatchEvent<Lazy<EndpointSlice>> = serde_json::from_str(&event).unwrap();
        let kube::core::WatchEvent::Modified(lazy) = ev else {
            panic!("not a MODIFIED event")
        };
        let direct: EndpointSlice = serde_json::from_str(SLICE).unwrap();
        assert_eq!(lazy.decode().unwrap(), direct);
    }

    #[test]
    fn escaped_keys_and_values_survive() {
        let odd =
            r#"{"metadata":{"name":"s"},"addressType":"IPv4","x\"y":"a\u00e9\"b","endpoints":[]}"#;
        let lazy: Lazy<EndpointSlice> = serde_json::from_str(odd).unwrap();
        assert!(lazy.decode().is_ok());
    }
}
