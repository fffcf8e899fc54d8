package topics

import (
	"math"
	"slices"
)

// A settings report is a device's own word on its settings, written by its
// bridge, and the server stores it and serves it to the device's user. A
// bridge, buggy or hostile, wrote what no setting is: a value of null, an
// object or an array; a setting named "", " " or with a control character;
// an enum naming a value twice. Stored as given, they reached users on GET
// …/settings, and a change of such a setting was sent to the device
// (docs/reliability.md, bug 567). ParseSettings and ParseReply hold each
// report to the rules below, so that the server and anything else reading
// one read it alike; what breaks them is named in Settings.Flaws for the
// reader to log.

// SettingsFlaws are the parts of a settings report that break the rules of
// a setting. Each list is sorted, each name as the report wrote it.
type SettingsFlaws struct {
	// NotNames are the names, of a reported value or of a spec, that no
	// setting has (ValidSettingName): left out, with their value and
	// their spec.
	NotNames []string
	// NoValues are the settings whose reported value no setting holds:
	// null, an object, an array, or a number too large for JSON to
	// write. Left out of Reported; their spec stays.
	NoValues []string
	// EnumValues are the enum settings whose values named one more than
	// once, or one that is not a value (empty, blank, with a control
	// character: ValidSettingName). Each value is kept once, where it is
	// first named, and the others are left out; an enum left with no
	// value is one Schema.Usable takes out.
	EnumValues []string
	// Unfit are the settings whose reported value is not a value of
	// their own spec: of another type, out of its min and max, longer
	// than its max_len, not among its values, not a time zone. They are
	// kept: the device is at that value, and a client shows it as the
	// device's. A change to a value of the spec is taken as any.
	Unfit []string
}

// Any reports whether f names anything.
func (f SettingsFlaws) Any() bool {
	return len(f.NotNames)+len(f.NoValues)+len(f.EnumValues)+len(f.Unfit) > 0
}

// ValidSettingName reports whether name can name a setting, and be a
// value of an enum: not empty, not blank (white space and format
// characters alone: a zero-width space, a BOM, which show nothing), and
// without a control character (C0, DEL, C1). A device's firmware names its
// settings and holds an enum's value as C strings, which a NUL ends, and a
// client shows each name, and each value of an enum for a user to pick.
func ValidSettingName(name string) bool {
	_, at := ControlChar(name, "")
	return at < 0 && !Blank(name)
}

// settingValue reports whether v, as Settings.UnmarshalJSON decodes it, is
// of a type some setting holds: a number (one JSON can write), true or
// false, a string.
func settingValue(v any) bool {
	switch x := v.(type) {
	case float64:
		return !math.IsInf(x, 0) && !math.IsNaN(x)
	case int64, int, bool, string:
		return true
	}
	return false
}

// clean holds s to the rules of a setting (see SettingsFlaws) and sets
// s.Flaws.
func (s *Settings) clean() {
	var f SettingsFlaws
	for name, v := range s.Reported {
		switch {
		case !ValidSettingName(name):
			f.NotNames = append(f.NotNames, name)
			delete(s.Reported, name)
		case !settingValue(v):
			f.NoValues = append(f.NoValues, name)
			delete(s.Reported, name)
		}
	}
	for name, spec := range s.Schema {
		if !ValidSettingName(name) {
			f.NotNames = append(f.NotNames, name) // maybe reported too: compacted below
			delete(s.Schema, name)
			continue
		}
		if spec.Type != SettingEnum {
			continue
		}
		if values, changed := enumValues(spec.Values); changed {
			spec.Values = values
			s.Schema[name] = spec
			f.EnumValues = append(f.EnumValues, name)
		}
	}
	f.Unfit = s.Schema.unfit(s.Reported)
	slices.Sort(f.NotNames)
	f.NotNames = slices.Compact(f.NotNames)
	slices.Sort(f.NoValues)
	slices.Sort(f.EnumValues)
	s.Flaws = f
}

// enumValues is values with each kept once, where first named, and
// without those that are not values (ValidSettingName), and whether any
// was left out.
func enumValues(values []string) ([]string, bool) {
	seen := make(map[string]bool, len(values))
	out := values[:0:0]
	for _, v := range values {
		if seen[v] || !ValidSettingName(v) {
			continue
		}
		seen[v] = true
		out = append(out, v)
	}
	if len(out) == len(values) {
		return values, false
	}
	return out, true
}

// unfit returns the names, sorted, of the reported values that are not
// values of their own spec (as a PUT's value is checked), of the settings
// the server can use (Schema.Usable). A time zone is looked up in the
// zone database once a name, and past maxZoneLookups names not at all,
// as ValidDefaults does: unfit only names what a reader logs.
func (s Schema) unfit(reported map[string]any) []string {
	var bad []string
	zones := zoneLookups{}
	for name, v := range reported {
		spec, ok := s[name]
		if !ok || !spec.usable() {
			continue
		}
		if zone, ok := v.(string); ok && spec.Type == SettingTimezone {
			if valid, looked := zones.valid(zone); looked && !valid {
				bad = append(bad, name)
			}
			continue
		}
		if spec.check(v) != "" {
			bad = append(bad, name)
		}
	}
	slices.Sort(bad)
	return bad
}
